"""``tune export``: convert a step checkpoint to Hugging Face (and PEFT) files, offline."""

import argparse
import re
from pathlib import Path

from toolkit.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes (binary multiples)."""
    match = _SIZE.match(text)
    if match is None:
        raise UserError(f"--max_shard_size: expected a size such as 5GB or 500MB, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))


def export(args: argparse.Namespace) -> int:
    """Run ``tune export`` (see :func:`toolkit.checkpoint.export.export_step_checkpoint`, which checks the
    checkpoint and ``--output`` before it writes anything)."""
    # Imported here so that `tune --help` and the other commands do not pay for importing torch.
    from toolkit.checkpoint.export import export_step_checkpoint
    from toolkit.checkpoint.step_files import named_step_checkpoint

    named = Path(args.checkpoint)
    checkpoint = named_step_checkpoint(named)
    if checkpoint != named:
        print(f"exporting {checkpoint}, the newest complete step checkpoint of {named}")
    written = export_step_checkpoint(
        checkpoint, Path(args.output), merged=args.merged, overwrite=args.overwrite,
        max_shard_bytes=parse_size(args.max_shard_size), base=args.base,
    )
    for path in written:
        print(f"wrote {path}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tune export`` on the ``tune`` subcommand parsers."""
    parser = commands.add_parser(
        "export",
        help="convert a step checkpoint to Hugging Face / PEFT files",
        description=(
            "Write the model of a step checkpoint (output_dir/checkpoints/step_<N>) as a Hugging Face folder,\n"
            "whatever the number of processes that saved it. An adapter-only checkpoint (LoRA, DoRA, QLoRA)\n"
            "becomes OUTPUT/adapter in PEFT's format, and with --merged also OUTPUT/merged. One process, streaming."
        ),
        epilog=(
            "examples:\n"
            "  tune export outputs/full_finetune_demo --output hf_model              # a run: its newest checkpoint\n"
            "  tune export outputs/short/checkpoints/step_6 --output short_step_6    # that step checkpoint\n"
            "  tune export outputs/lora_finetune_demo --output lora_export --merged  # adapter/ and merged/"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT",
        help="a checkpoints/step_<N> folder, or a run's output_dir for its newest complete checkpoint",
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="folder to write")
    parser.add_argument("--merged", action="store_true", help="adapters: also write the merged model")
    parser.add_argument("--max_shard_size", default="5GB", metavar="SIZE", help="largest safetensors file (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument(
        "--base", metavar="DIR",
        help="where the run's base checkpoint (its checkpointer.checkpoint_dir) is now, if it moved since the run",
    )
    parser.set_defaults(handler=export)
