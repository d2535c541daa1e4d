"""``tune run``: validate the config, then run a recipe in this process or under torchrun."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import runpy
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from toolkit.cli._catalog import config_for_recipe, recipe_path, recipe_schema, split_launch_suffix
from toolkit.cli._cluster_env import check_interface_names, worker_environment
from toolkit.cli._threads import choose_threads, usable_cores
from toolkit.config import Schema, apply_overrides, did_you_mean, load_config, recipe_keys, validate
from toolkit.config._parse import split_config_arg
from toolkit.config._recipe import LAUNCHER_REPORTS_ERRORS_ENV, USER_ERROR_KEY
from toolkit.errors import UserError, print_error
from toolkit.quiet import verbose

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
--standalone; see `torchrun --help`. TUNE_VERBOSE=1 shows torchrun's own logs and third-party start-up messages.

On one node without --master_port the processes meet on a free port. A port this node must listen on that is
taken stops the launch at once. Several nodes wait for each other at most 300 s (--rdzv_conf
join_timeout=SECONDS to change), then stop with what to check. For the workers, tune sets what the environment
leaves unset, each said in one line: on several nodes the network interface that reaches the rendezvous host
(NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); on GPUs the InfiniBand devices, NCCL's error handling and its flight
recorder, dumped to output_dir on a timeout (see docs/multi_node.md).

examples:
  tune run full_finetune_single_device --config demo
  tune run --nproc_per_node 2 full_finetune_distributed --config demo batch_size=8
  tune run --nnodes 2 --node_rank 0 --rdzv_endpoint host:29400 full_finetune_distributed --config demo
  tune run my_recipe.py --config my_demo.yaml     # files copied with tune cp (see tune cp --help)"""

# The words torchrun accepts for --nproc_per_node besides a number.
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")
# How long the nodes wait for each other at the rendezvous unless --rdzv_conf says: time for a scheduler to start
# every node, yet a node that never comes (a wrong address, a firewall, a command not run) is reported in minutes,
# not after torchrun's ten.
_JOIN_TIMEOUT_S = 300
# torchrun's ports when none is given: the static rendezvous's --master_port, and c10d's endpoint.
_STATIC_PORT = 29500
_C10D_PORT = 29400
# How long a port found taken may take to answer as a rendezvous store (another node's, on this machine).
_STORE_PROBE_S = 5.0


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


def _run_single_cpu_process(path: Path, recipe_args: list[str]) -> int:
    """One CPU process, this one, with the idle cores' threads (toolkit/cli/_threads.py); the count is restored
    afterwards, so a later run in this process (a test, a notebook) keeps its own."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(choose_threads(1).threads)
    try:
        return _run_single_device(path, recipe_args)
    finally:
        torch.set_num_threads(saved)


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
        print_error(str(user_errors[min(user_errors)]))
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
    print_error(f"{details}; see that rank's output above")
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


def _world_size(launch: argparse.Namespace) -> int | None:
    """The processes the launch will start, all nodes together (None where an elastic range leaves it open).

    Fills in ``--nproc_per_node`` when it was not given: one process per GPU, or up to 4 CPU processes.
    """
    import torch

    if launch.nproc_per_node is None:
        if torch.cuda.is_available():
            launch.nproc_per_node = str(torch.cuda.device_count())
        else:
            count = min(usable_cores(), 4)
            launch.nproc_per_node = str(count)
            message = f"no GPU found: {count} CPU processes on gloo (set --nproc_per_node to change)"
            print(f"tune: {message}", file=sys.stderr)
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(launch.nnodes)
    nproc = launch.nproc_per_node
    if not nproc.isdigit() or min_nodes != max_nodes:
        return None  # `auto`/`gpu` or an elastic node range: known only once the job has formed
    return int(nproc) * int(max_nodes)


def _check_gpus_per_node(launch: argparse.Namespace, *, device: str) -> None:
    """Refuse more processes on this node than it has GPUs, where the recipe will use them (``device`` ``cuda``, or
    ``auto`` on a machine with a GPU): each process takes the GPU of its local rank, and torch would stop the
    extra ones with 'invalid device ordinal' after the launch."""
    import torch

    nproc = launch.nproc_per_node
    if device == "cpu" or not nproc.isdigit() or not torch.cuda.is_available():
        return
    gpus = torch.cuda.device_count()
    if int(nproc) > gpus:
        raise UserError(
            f"--nproc_per_node {nproc}: this node has {gpus} GPU(s) and each process takes one (device: {device}); "
            f"start at most {gpus} per node (more GPUs for tensor_parallel or the other splits: --nnodes), "
            "or device=cpu for CPU processes"
        )


def _uses_gpus(device: str) -> bool:
    """Whether the recipe's processes will run on GPUs, where NCCL carries their collectives."""
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


@dataclass(frozen=True)
class _Rendezvous:
    """Where this launch's nodes meet, for the messages about it."""

    host: str
    port: int
    nodes: int
    join_timeout_s: int
    flags: str  # the flags that name the endpoint, e.g. "--master_addr and --master_port"


def _set_join_timeout(launch: argparse.Namespace) -> int:
    """Put the time the nodes wait for each other in ``--rdzv_conf``: the user's, else ``_JOIN_TIMEOUT_S``.

    Returns:
        That time, in seconds.

    Raises:
        UserError: a malformed ``--rdzv_conf`` or timeout, which torchrun would answer with a traceback.
    """
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    try:
        conf = _parse_rendezvous_config(launch.rdzv_conf)  # torchrun's own parser: the same keys it will see
    except ValueError as e:
        raise UserError(f"--rdzv_conf '{launch.rdzv_conf}': {e}") from None
    # The static rendezvous calls it `timeout`; `join_timeout`, c10d's name (and --standalone's), works for both.
    key = "timeout" if launch.rdzv_backend == "static" and not launch.standalone else "join_timeout"
    given = conf.get(key) or conf.get("join_timeout")
    if given is not None and not (given.isdigit() and int(given) > 0):
        raise UserError(f"--rdzv_conf {key}={given}: the time the nodes wait for each other must be a whole "
                        f"number of seconds above 0")
    conf[key] = given or str(_JOIN_TIMEOUT_S)
    launch.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())
    return int(conf[key])


def _prepare_rendezvous(launch: argparse.Namespace, join_timeout_s: int) -> _Rendezvous | None:
    """Where the nodes meet, having checked that the port this node will listen on, if it hosts the rendezvous,
    is free.

    Returns:
        The rendezvous, or None for the backends left to torchrun (etcd).

    Raises:
        UserError: a malformed endpoint, or a port this node cannot listen on.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import (
        _matches_machine_hostname,
        _parse_rendezvous_config,
        parse_rendezvous_endpoint,
    )

    if launch.rdzv_backend not in ("static", "c10d"):
        return None
    endpoint = launch.rdzv_endpoint
    try:
        if launch.rdzv_backend == "static" and not endpoint:
            host, port = launch.master_addr, launch.master_port or _STATIC_PORT
            flags = "--master_addr and --master_port"
        else:
            host, port = parse_rendezvous_endpoint(endpoint, -1 if launch.rdzv_backend == "static" else _C10D_PORT)
            flags = "--rdzv_endpoint"
    except ValueError as e:
        raise UserError(f"--rdzv_endpoint '{endpoint}': {e}") from None
    # Read as torchrun reads it (1/0, true/false, yes/no...); --rdzv_conf was parsed once already.
    conf = RendezvousParameters("c10d", endpoint, "tune", 1, 1, **_parse_rendezvous_config(launch.rdzv_conf))
    try:
        is_host = conf.get_as_bool("is_host")
    except ValueError as e:
        raise UserError(f"--rdzv_conf is_host={conf.get('is_host')}: {e}") from None
    if port == -1:
        raise UserError(f"--rdzv_endpoint '{endpoint}' has no port: write HOST:PORT")
    if not 0 < port < 65536:
        raise UserError(f"the rendezvous port {port} is not a port number (1 to 65535)")
    rendezvous = _Rendezvous(host, port, _max_nodes(launch), join_timeout_s, flags)
    if launch.rdzv_backend == "static":
        # Node 0 hosts the store, on every address of its machine.
        port_flag = "--rdzv_endpoint" if endpoint else "--master_port"
        if not endpoint and launch.master_port is None:
            port_flag = "the default --master_port"
        _check_port_free(rendezvous, hosted=launch.node_rank == 0, port_flag=port_flag, might_share=False)
    else:
        # torchrun's own test of whether this node hosts the store (the endpoint's host is this machine), unless
        # is_host says. Where it guessed, a port found taken is tried as a client: it may be another node's store.
        hosted = is_host if is_host is not None else _matches_machine_hostname(host)
        _check_port_free(rendezvous, hosted=hosted, port_flag="--rdzv_endpoint", might_share=is_host is None)
    return rendezvous


def _check_port_free(rendezvous: _Rendezvous, *, hosted: bool, port_flag: str, might_share: bool) -> None:
    """Refuse a port this node will listen on that it cannot listen on.

    Without this, torchrun fails with a traceback (EADDRINUSE), or, where it may share the port with another node's
    store (c10d), connects to whatever listens there and waits for it until the timeouts run out.
    """
    if not hosted:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the store does: a port left in TIME_WAIT by an earlier run is free to listen on; a listening one is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", rendezvous.port))
            return
        except OSError as e:
            error = e
    port = rendezvous.port
    if error.errno != errno.EADDRINUSE:
        raise UserError(f"cannot host the rendezvous on port {port} ({port_flag}): {error.strerror}")
    if might_share and _store_answers(rendezvous.host, port):
        return  # another node's launcher on this machine hosts the rendezvous: this node joins it
    where = "give every node the same free one" if rendezvous.nodes > 1 else f"or leave {port_flag} out"
    raise UserError(
        f"cannot host the rendezvous on port {port} ({port_flag}): address already in use by another program or "
        f"run on this machine; choose a free port ({where})"
    )


def _store_answers(host: str, port: int) -> bool:
    """Whether a torch.distributed store answers at ``host:port``, rather than some other program."""
    from torch.distributed import TCPStore

    answered: list[bool] = []

    def connect() -> None:
        try:
            TCPStore(host, port, is_master=False, timeout=timedelta(seconds=1), wait_for_workers=False)
            answered.append(True)
        except (RuntimeError, TimeoutError, ValueError):  # DistNetworkError is a RuntimeError
            pass

    # In a thread, waited for a few seconds only: against some listeners (seen with "localhost") the client ignores
    # its timeout and never returns. A store on this machine answers in milliseconds.
    probe = threading.Thread(target=connect, name="tune-store-probe", daemon=True)
    probe.start()
    probe.join(_STORE_PROBE_S)
    return bool(answered)


def _rendezvous_failure(error: BaseException, rendezvous: _Rendezvous) -> str:
    """One line for a rendezvous that did not complete: what happened and what to check."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousConnectionError,
        RendezvousTimeoutError,
    )

    where = f"{rendezvous.host}:{rendezvous.port}"
    # torch's own words, for the details: the inner exception where the outer one only points to it.
    cause = error.__cause__ if isinstance(error, RendezvousConnectionError) and error.__cause__ else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    detail = f" ({type(cause).__name__}: {lines[0]})" if lines else ""
    if isinstance(error, RendezvousClosedError):
        return f"the rendezvous at {where} was closed: another node of this job has stopped; see its output"
    if isinstance(error, (RendezvousConnectionError, DistNetworkError)):
        return (f"could not reach the rendezvous at {where}{detail}: check that the node hosting it was started, "
                f"that {rendezvous.flags} give an address of it that this node can reach, and that no firewall "
                f"blocks port {rendezvous.port}")
    timed_out = isinstance(error, RendezvousTimeoutError) or "timed out" in str(error).lower()
    happened = (f"not all {rendezvous.nodes} nodes joined the rendezvous at {where} within "
                f"{rendezvous.join_timeout_s} s" if timed_out else f"the rendezvous at {where} failed")
    return (f"{happened}{detail}: check that every node was started with the same --nnodes, {rendezvous.flags} "
            f"and --rdzv_id, that {rendezvous.host} is reachable from every node on port {rendezvous.port} "
            f"(address, firewall), or wait longer with --rdzv_conf join_timeout=SECONDS")


def _run_distributed(
    launch: argparse.Namespace, path: Path, recipe_args: list[str], *, uses_gpus: bool, output_dir: str | None
) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import run

    launch.training_script = str(path)
    launch.training_script_args = recipe_args
    single_node = _max_nodes(launch) == 1 and launch.rdzv_backend == "static" and not launch.rdzv_endpoint
    if single_node and launch.master_port is None:
        # Rendezvous on a free port, so two runs on one machine do not fight over 29500.
        launch.standalone = True
    join_timeout_s = _set_join_timeout(launch)
    rendezvous = None if launch.standalone else _prepare_rendezvous(launch, join_timeout_s)
    # NCCL and gloo set up for the cluster, where the user left them unset (none on one node of CPU processes).
    several = (rendezvous.host, rendezvous.port) if rendezvous is not None and rendezvous.nodes > 1 else None
    chosen = worker_environment(rendezvous=several, uses_gpus=uses_gpus, output_dir=output_dir, environ=os.environ)
    for _, line in chosen:
        print(f"tune: {line}", file=sys.stderr)
    if not uses_gpus and "OMP_NUM_THREADS" not in os.environ:
        # CPU processes share out the idle cores (the run's header says how many threads each has).
        from torch.distributed.run import determine_local_world_size

        threads = choose_threads(determine_local_world_size(launch.nproc_per_node)).threads
        chosen.append(({"OMP_NUM_THREADS": str(threads)}, ""))
    if rendezvous is not None and rendezvous.nodes > 1:
        print(f"tune: waiting up to {rendezvous.join_timeout_s} s for the {rendezvous.nodes} nodes to meet at "
              f"{rendezvous.host}:{rendezvous.port}", file=sys.stderr)
    if not verbose():
        # Failures are summarized in one line below; torchrun's banners and tables would bury it. Each
        # torchrun module sets its own logger's level, so setting the parents' is not enough.
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(_TORCHRUN_LOGGERS):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    # What the workers inherit, restored afterwards: a later run in this process (a test, a notebook) is on its own.
    names = [LAUNCHER_REPORTS_ERRORS_ENV, _SHARE_STORE_ENV, *(name for values, _ in chosen for name in values)]
    saved_env = {name: os.environ.get(name) for name in names}
    for values, _ in chosen:
        os.environ.update(values)
    os.environ[LAUNCHER_REPORTS_ERRORS_ENV] = "1"
    # A fresh store for every rendezvous round (c10d), hosted by that round's rank 0, instead of one kept by the
    # launcher across rounds: after a restart, the old round's keys (the dead ranks' addresses) would be read by the
    # new workers, and the nodes cannot tell the rounds apart by TORCHELASTIC_RESTART_COUNT, which torchrun counts
    # per node (only the node where a worker failed raises it). The static rendezvous ignores this; there
    # init_distributed keeps the attempts apart in the launcher's store.
    os.environ.setdefault(_SHARE_STORE_ENV, "1")
    try:
        run(launch)
    except ChildFailedError as e:
        return _report_failure(e.failures)
    except (RendezvousError, DistError) as e:
        # The launcher's own rendezvous (the workers' errors come as ChildFailedError): the nodes did not meet.
        if rendezvous is None:
            raise
        raise UserError(_rendezvous_failure(e, rendezvous)) from None
    except SignalException as e:
        # Ctrl-C (or a scheduler's SIGTERM) reached the launcher; torchrun has stopped the workers.
        if e.sigval != signal.SIGINT:
            print(f"tune: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + int(e.sigval)
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return 0


def _import_torch_quietly(argv: list[str]) -> None:
    """Import torch with its C++ logs off in a launcher (unless TUNE_VERBOSE=1 or TORCH_CPP_LOG_LEVEL is set).

    While the nodes meet, the store's client logs every failed attempt to connect with a C++ stack trace; the
    launch's outcome is the one line ``tune run`` prints. The level is read once, when torch's library loads, and
    the variable is removed again at once so the workers log as usual. A launch is recognized before parsing
    (the parser is torch's): flags before the recipe, or a ``_distributed`` recipe.
    """
    if "torch" in sys.modules or verbose() or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    if not (argv[0].startswith("-") or any(arg.endswith("_distributed") for arg in argv)):
        return  # one device: the recipe runs in this process, which keeps torch's logs
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _check_output_dir(cfg: Any, schema: Schema | None) -> None:
    """Refuse an output folder the run would refuse (a finished run without overwrite, a base checkpoint inside it,
    a folder it cannot write) before any process starts, as the recipe's rank 0 checks it again before it writes."""
    if schema is None or not {"output_dir", "overwrite", "resume_from"} <= schema.keys.keys():
        return
    from toolkit.training import start_run

    checkpointer = cfg.get("checkpointer")
    start_run(
        cfg.output_dir, overwrite=cfg.overwrite, resume_from=cfg.resume_from,
        base_checkpoint=checkpointer.get("checkpoint_dir") if checkpointer is not None else None,
    )


def run_command(argv: Sequence[str]) -> int:
    """``tune run``; see ``HELP``.

    Returns:
        The exit code: the recipe's own on one device; 0, 1 (a crash) or 2 (a user error) under torchrun.
    """
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(HELP, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    _import_torch_quietly(argv)
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
            folder = path.parent
            siblings = [str(folder / p.name) for p in folder.glob("*.py")] if folder.is_dir() else []
            raise UserError(f"no such recipe file '{token}'{did_you_mean(token, siblings)}")
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
    schema = recipe_schema(path)
    apply_overrides(cfg, overrides, recipe=recipe_keys(path), moved=schema.moved if schema is not None else None)
    world = _world_size(launch) if distributed else 1
    validate(cfg, schema=schema, world_size=world)
    if distributed:
        device = str(cfg.get("device", "auto"))
        _check_gpus_per_node(launch, device=device)
        uses_gpus = _uses_gpus(device)
        check_interface_names(uses_gpus=uses_gpus, environ=os.environ)
    if not distributed or launch.node_rank == 0:  # where rank 0, which writes the run, will be
        _check_output_dir(cfg, schema)

    recipe_argv = ["--config", str(config_path), *overrides]
    if distributed:
        output_dir = cfg.get("output_dir")
        return _run_distributed(
            launch, path, recipe_argv, uses_gpus=uses_gpus, output_dir=None if output_dir is None else str(output_dir)
        )
    if not _uses_gpus(str(cfg.get("device", "auto"))) and "OMP_NUM_THREADS" not in os.environ:
        return _run_single_cpu_process(path, recipe_argv)
    return _run_single_device(path, recipe_argv)
