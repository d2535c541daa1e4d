"""``tune merge``: merge a PEFT LoRA/DoRA adapter into a Hugging Face base checkpoint, offline."""

import argparse


def merge(args: argparse.Namespace) -> int:
    """Run ``tune merge`` (see :func:`toolkit.checkpoint.peft.merge_adapter_into_checkpoint`)."""
    # Imported here so that `tune --help` and the other commands do not pay for importing torch.
    from toolkit.checkpoint.peft import merge_adapter_into_checkpoint

    out = merge_adapter_into_checkpoint(args.base, args.adapter, args.output, overwrite=args.overwrite)
    print(f"merged {args.adapter} into {args.base}: wrote {out}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tune merge`` on the ``tune`` subcommand parsers."""
    parser = commands.add_parser(
        "merge",
        help="merge a LoRA/DoRA adapter into its base checkpoint",
        description=(
            "Write a Hugging Face checkpoint whose weights are the base's with a PEFT-format LoRA or DoRA adapter\n"
            "merged in. Works on the files (any model family), one safetensors file in memory at a time."
        ),
        epilog=(
            "examples:\n"
            "  tune merge --base outputs/full_finetune_demo/final --adapter outputs/lora_on_demo/final/adapter "
            "--output merged_demo"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", required=True, metavar="DIR", help="the base model's Hugging Face folder")
    parser.add_argument(
        "--adapter", required=True, metavar="DIR", help="PEFT adapter folder (adapter_config.json + safetensors)"
    )
    parser.add_argument("--output", required=True, metavar="DIR", help="folder to write (must not exist)")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.set_defaults(handler=merge)
