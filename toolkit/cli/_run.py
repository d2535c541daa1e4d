"""``tune run``: validate the config, then run a recipe in this process or under torchrun."""

from __future__ import annotations

import argparse
import logging
import os
import runpy
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from toolkit.cli._catalog import config_for_recipe, recipe_path, recipe_schema, split_launch_suffix
from toolkit.config import apply_overrides, load_config, recipe_keys, validate
from toolkit.config._parse import split_config_arg
from toolkit.config._recipe import LAUNCHER_REPORTS_ERRORS_ENV, USER_ERROR_KEY
from toolkit.errors import UserError

USAGE = "tune run [TORCHRUN FLAGS] RECIPE[_single_device|_distributed] --config CONFIG [key=value ...] [~key ...]"

HELP = f"""usage: {USAGE}

Run a recipe. The suffix says how:
  RECIPE_single_device   one process, this one
  RECIPE_distributed     torchrun: one process per local GPU (or --nproc_per_node N; without a GPU,
                         up to 4 CPU processes on gloo), on one node or several (--nnodes, --rdzv_endpoint)
RECIPE is a name from `tune ls` or a path to a recipe file (a path, or a name without suffix, runs on one
device unless torchrun flags are given).

CONFIG is a file path, a config name of the recipe, or recipe/config. key=value overrides a config value
(YAML: lr=1e-4, dims=[1,2], name=null); ~key deletes one. The config is loaded, overridden and validated
before anything is launched.

TORCHRUN FLAGS (before RECIPE) are passed to torchrun unchanged, e.g. --nproc_per_node, --nnodes,
--node_rank, --rdzv_backend, --rdzv_endpoint, --rdzv_id, --master_addr, --master_port, --max_restarts,
--standalone; see `torchrun --help`. TUNE_VERBOSE=1 shows torchrun's own logs.

examples:
  tune run full_finetune_single_device --config demo
  tune run full_finetune_distributed --nproc_per_node 2 --config demo batch_size=8
  tune run --nnodes 2 --node_rank 0 --rdzv_endpoint host:29400 full_finetune_distributed --config demo
  tune run my_recipe.py --config my_config.yaml"""

# The words torchrun accepts for --nproc_per_node besides a number.
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
_TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")


def _torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "tune run"
    # None tells "not given" from torchrun's default of 1, so we can pick one process per accelerator.
    parser.set_defaults(nproc_per_node=os.environ.get("PET_NPROC_PER_NODE"))

    def error(message: str) -> Any:
        if "training_script" in message:  # torchrun's name for the positional we call RECIPE
            message = "no recipe given"
        raise UserError(f"{message}; see `tune run --help`")

    parser.error = error  # type: ignore[method-assign]
    return parser


def _split_torchrun_flags(parser: argparse.ArgumentParser, args: list[str]) -> tuple[list[str], list[str]]:
    """Separate torchrun flags written after the recipe (``RECIPE --nproc_per_node 2 --config ...``) from the
    recipe's own ``--config`` and overrides, so the flags may go on either side of the recipe."""
    actions = parser._option_string_actions  # argparse's table of option strings, stable since Python 3.2
    flags: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name == "--config" or not arg.startswith("-"):
            rest.append(arg)
            # The value of --config is the recipe's, whatever it looks like.
            if arg == "--config" and i + 1 < len(args):
                rest.append(args[i + 1])
                i += 1
        elif name in actions:
            flags.append(arg)
            takes_value = actions[name].nargs != 0
            if takes_value and "=" not in arg and i + 1 < len(args):
                flags.append(args[i + 1])
                i += 1
        else:
            raise UserError(f"unknown option '{arg}': not --config nor a torchrun flag; see `tune run --help`")
        i += 1
    return flags, rest


def _exit_code(code: object) -> int:
    """What the interpreter would exit with for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_single_device(path: Path, recipe_args: list[str]) -> int:
    saved_argv, saved_path = sys.argv, list(sys.path)
    # Exactly what `python recipe.py ...` would see: its argv, and its own folder first on the import path.
    sys.argv = [str(path), *recipe_args]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        return _exit_code(e.code)
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


# What a rank's exception says when it failed only because another rank died under it: its collective lost
# the connection. Such a rank is a consequence, named after the ranks whose failure was their own.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo/transport/",
              "nccl communicator was aborted", "watchdog caught collective operation timeout")


# What a rank's exception says when its collective (or the store) waited past dist_timeout_s.
_TIMED_OUT = ("timed out", "timeout")


def _message(failure: Any) -> str:
    """The last line of the exception the rank's error file holds, or ''."""
    if not os.path.isfile(failure.error_file):
        return ""
    # The recipe's `record` wrapper stored the exception there: its last line names the exception and message.
    message = getattr(failure, "message", "")
    if isinstance(message, dict):  # torchrun keeps the error file's {"message": ..., "extraInfo": ...}
        message = message.get("message", "")
    lines = [line for line in str(message).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _describe(rank: int, failure: Any) -> str:
    if failure.exitcode == -signal.SIGTERM and _recorded(failure):  # it raised, then torchrun stopped it
        what = "failed, and was stopped by the launcher while exiting"
    elif failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"exited with code {failure.exitcode}"
    if not os.path.isfile(failure.error_file):
        return f"rank {rank} {what} (error file: none written)"
    message = _message(failure)
    cause = f": {message}" if message else ""
    return f"rank {rank} {what}{cause} (error file: {failure.error_file})"


def _recorded(failure: Any) -> bool:
    return os.path.isfile(failure.error_file) and isinstance(failure.error_file_data, dict)


def _report_failure(failures: dict[int, Any]) -> int:
    # A rank torchrun stopped (SIGTERM) may still have recorded its own error before the signal came: it counts.
    user_errors = {
        rank: failure.error_file_data[USER_ERROR_KEY]
        for rank, failure in failures.items()
        if failure.exitcode in (2, -signal.SIGTERM) and _recorded(failure) and USER_ERROR_KEY in failure.error_file_data
    }
    if user_errors:
        # The recipe left its one-line message for us instead of printing it; show the lowest rank's, once.
        for line in str(user_errors[min(user_errors)]).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    # SIGTERM is how torchrun stops the ranks still running once one has failed: a rank it stopped is a cause only
    # if it had recorded an exception of its own first.
    causes = {
        rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM or _recorded(f)
    } or failures
    if all(f.exitcode == 2 for f in causes.values()):
        return 2  # a user error the recipe has already printed

    def order(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        lost_peer = any(pattern in _message(failure).lower() for pattern in _PEER_LOST)
        return lost_peer, failure.timestamp, rank

    details = "; ".join(_describe(rank, failure) for rank, failure in sorted(causes.items(), key=order))
    # A collective that timed out names the ranks that waited, not the one they waited for: that one was still
    # running (stuck elsewhere) when torchrun stopped it, silently, or it runs on another node.
    stopped = sorted(rank for rank in failures if rank not in causes)
    if stopped and all(any(word in _message(f).lower() for word in _TIMED_OUT) for f in causes.values()):
        ranks = ", ".join(map(str, stopped))
        details += (f"; a collective timed out: the rank it waited for is one of those still running when stopped "
                    f"(here: {ranks}) or on another node")
    print(f"tune: error: {details}; see that rank's output above", file=sys.stderr)
    return 1


def _max_nodes(launch: argparse.Namespace) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    try:
        _, max_nodes = parse_min_max_nnodes(launch.nnodes)
    except (ValueError, RuntimeError):
        raise UserError(f"--nnodes must be N or MIN:MAX, got '{launch.nnodes}'") from None
    return int(max_nodes)


def _check_launch_flags(launch: argparse.Namespace) -> None:
    """Catch the flag mistakes torchrun would answer with a traceback."""
    _max_nodes(launch)
    nproc = launch.nproc_per_node
    if nproc is not None and nproc not in _NPROC_WORDS and not (nproc.isdigit() and int(nproc) > 0):
        words = ", ".join(_NPROC_WORDS)
        raise UserError(f"--nproc_per_node must be a positive number or one of {words}, got '{nproc}'")


def _data_parallel_size(launch: argparse.Namespace) -> int | None:
    """The processes the launch will start, all nodes together (None where an elastic range leaves it open).

    Fills in ``--nproc_per_node`` when it was not given: one process per GPU, or up to 4 CPU processes.
    """
    import torch

    if launch.nproc_per_node is None:
        if torch.cuda.is_available():
            launch.nproc_per_node = str(torch.cuda.device_count())
        else:
            count = min(os.cpu_count() or 1, 4)
            launch.nproc_per_node = str(count)
            message = f"no GPU found: {count} CPU processes on gloo (set --nproc_per_node to change)"
            print(f"tune: {message}", file=sys.stderr)
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(launch.nnodes)
    nproc = launch.nproc_per_node
    if not nproc.isdigit() or min_nodes != max_nodes:
        return None  # `auto`/`gpu` or an elastic node range: known only once the job has formed
    return int(nproc) * int(max_nodes)


def _run_distributed(launch: argparse.Namespace, path: Path, recipe_args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    launch.training_script = str(path)
    launch.training_script_args = recipe_args
    single_node = _max_nodes(launch) == 1 and launch.rdzv_backend == "static" and not launch.rdzv_endpoint
    if single_node and launch.master_port is None:
        # Rendezvous on a free port, so two runs on one machine do not fight over 29500.
        launch.standalone = True
    if os.environ.get("TUNE_VERBOSE") != "1":
        # Failures are summarized in one line below; torchrun's banners and tables would bury it. Each
        # torchrun module sets its own logger's level, so setting the parents' is not enough.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(_TORCHRUN_LOGGERS):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ[LAUNCHER_REPORTS_ERRORS_ENV] = "1"
    # A fresh store for every rendezvous round (c10d), hosted by that round's rank 0, instead of one kept by the
    # launcher across rounds: after a restart, the old round's keys (the dead ranks' addresses) would be read by the
    # new workers, and the nodes cannot tell the rounds apart by TORCHELASTIC_RESTART_COUNT, which torchrun counts
    # per node (only the node where a worker failed raises it). The static rendezvous ignores this; there
    # init_distributed keeps the attempts apart in the launcher's store.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        run(launch)
    except ChildFailedError as e:
        return _report_failure(e.failures)
    except SignalException as e:
        # Ctrl-C (or a scheduler's SIGTERM) reached the launcher; torchrun has stopped the workers.
        if e.sigval != signal.SIGINT:
            print(f"tune: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def run_command(argv: Sequence[str]) -> int:
    """``tune run``; see ``HELP``.

    Returns:
        The exit code: the recipe's own on one device; 0, 1 (a crash) or 2 (a user error) under torchrun.
    """
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    parser = _torchrun_parser()
    launch = parser.parse_args(argv)
    token: str = launch.training_script
    if any(arg in ("-h", "--help") for arg in launch.training_script_args):
        print(HELP)
        return 0
    flags_before = argv[: len(argv) - len(launch.training_script_args) - 1]
    flags_after, recipe_args = _split_torchrun_flags(parser, launch.training_script_args)
    flags = flags_before + flags_after
    if flags_after:
        launch = parser.parse_args([*flags, token])
    if launch.module or launch.no_python:
        raise UserError("tune run launches recipe files: -m/--module and --no-python are not supported")

    if token.endswith(".py") or os.sep in token or "/" in token:
        path, recipe, suffix = Path(token), None, None  # a copied recipe: no configs of its own
        if not path.is_file():
            raise UserError(f"no such recipe file '{token}'")
    else:
        path = recipe_path(token)
        recipe, suffix = split_launch_suffix(token)
    if suffix == "_single_device" and flags:
        raise UserError(f"torchrun flags ({' '.join(flags)}) need a distributed launch: use {recipe}_distributed")
    distributed = suffix == "_distributed" or (suffix is None and bool(flags))
    if distributed:
        _check_launch_flags(launch)

    config_name, overrides = split_config_arg(recipe_args)
    config_path = config_for_recipe(config_name, recipe)
    # Check everything here (the recipe's declared schema too, with the number of processes the launch will start),
    # so that a mistake costs no process launch.
    cfg = load_config(config_path)
    apply_overrides(cfg, overrides, recipe=recipe_keys(path))
    world = _data_parallel_size(launch) if distributed else 1
    validate(cfg, schema=recipe_schema(path), data_parallel_size=world)

    recipe_argv = ["--config", str(config_path), *overrides]
    if distributed:
        return _run_distributed(launch, path, recipe_argv)
    return _run_single_device(path, recipe_argv)
