"""``tune download``: fetch a model repository from the Hugging Face hub into a folder configs point at."""

import argparse
import shlex
from pathlib import Path

from toolkit.errors import UserError

DEFAULT_ROOT = "~/models"


def default_output_dir(repo_id: str) -> str:
    """Where ``tune download`` puts ``repo_id`` without ``--output-dir``: ``~/models/<name>``, expanded (shipped
    configs read from there)."""
    return str(Path(DEFAULT_ROOT).expanduser() / repo_id.split("/")[-1])


def _retry_command(args: argparse.Namespace, output_dir: str) -> str:
    parts = ["tune", "download", args.repo_id, "--output-dir", output_dir]
    for flag, patterns in (("--include", args.include), ("--exclude", args.exclude)):
        if patterns:
            parts += [flag, *patterns]
    if args.hf_token:
        parts += ["--hf-token", "<your token>"]  # never echo a secret into logs
    return shlex.join(parts)


def download(args: argparse.Namespace) -> int:
    """Download ``args.repo_id`` with ``huggingface_hub.snapshot_download``; print the folder.

    Raises:
        UserError: no network, an unknown or gated repository, or a refused token, with the command to retry.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    output_dir = str(Path(args.output_dir).expanduser()) if args.output_dir else default_output_dir(args.repo_id)
    retry = _retry_command(args, output_dir)
    try:
        path = snapshot_download(
            args.repo_id,
            local_dir=output_dir,
            token=args.hf_token,
            allow_patterns=args.include,
            ignore_patterns=args.exclude,
        )
    except GatedRepoError:
        raise UserError(
            f"{args.repo_id} is gated: accept its license on https://huggingface.co/{args.repo_id}, then pass "
            f"--hf-token (or set HF_TOKEN) and retry: {retry}"
        ) from None
    except RepositoryNotFoundError:
        raise UserError(
            f"{args.repo_id}: no such repository, or it is private and the token does not grant access; "
            f"check the name and token, then retry: {retry}"
        ) from None
    except RevisionNotFoundError as e:
        raise UserError(f"{args.repo_id}: {e}; retry: {retry}") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        # LocalEntryNotFoundError is what the hub client raises when it cannot connect at all.
        reason = str(e).splitlines()[0]
        raise UserError(
            f"could not download {args.repo_id} ({reason}); check the network, then retry: {retry}"
        ) from None
    print(f"downloaded {args.repo_id} to {path}")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``tune download`` on the ``tune`` subcommand parsers."""
    parser = commands.add_parser(
        "download",
        help="download a model from the Hugging Face hub",
        description="Download a model repository from the Hugging Face hub.",
        epilog="examples:\n  tune download meta-llama/Llama-3.2-1B-Instruct --exclude 'original/consolidated*'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("repo_id", help="hub repository, e.g. Qwen/Qwen2.5-0.5B-Instruct")
    parser.add_argument(
        "--output-dir", default=None, help=f"folder to download into (default: {DEFAULT_ROOT}/<repository name>)"
    )
    parser.add_argument(
        "--hf-token", default=None, help="hub access token for gated or private models (default: HF_TOKEN)"
    )
    parser.add_argument("--include", nargs="+", metavar="PATTERN", help="download only files matching these globs")
    parser.add_argument("--exclude", nargs="+", metavar="PATTERN", help="skip files matching these globs")
    parser.set_defaults(handler=download)
