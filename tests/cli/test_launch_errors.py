"""tune run's launcher: a rendezvous port that is taken, and nodes that never meet, stop at once or after the join
timeout with one line saying what to check, instead of a hang or torchrun's traceback."""

from __future__ import annotations

import argparse
import socket
import subprocess
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from tests.cli.conftest import TUNE_COMMAND, one_line, tune_env
from tests.launch import free_port

# tune's exit code for a UserError (toolkit/cli/main.py's _report, 2 on main since every tune command exits 2 for one).
USER_ERROR = 2


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other program listens on (and never answers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def launch(tree, *flags: str, env: dict[str, str] | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """`tune run FLAGS toy_distributed` on one CPU process per node, in a subprocess."""
    # No GPU, also on a machine with one: the lines tune run prints about the NCCL settings it makes stay out of the
    # messages checked here.
    return subprocess.run(
        [*TUNE_COMMAND, "run", *flags, "--nproc_per_node", "1", "toy_distributed", "--config", "small"],
        cwd=tree.work, capture_output=True, text=True, timeout=timeout_s,
        env={**tune_env(tree), "CUDA_VISIBLE_DEVICES": "", **(env or {})},
    )


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--master_port", "{port}"], "--master_port"),
        # c10d guesses that this node hosts the store and, finding the port taken, would join whatever listens there
        # and wait for it: torchrun hung for its 60 s read timeout, then for the join timeout.
        (["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:{port}"], "--rdzv_endpoint"),
    ],
    ids=["static", "c10d"],
)
def test_a_taken_port_stops_before_any_process_starts(tree, taken_port, flags: list[str], flag: str) -> None:
    started = time.monotonic()
    result = launch(tree, *(f.format(port=taken_port) for f in flags), timeout_s=90)
    assert result.returncode == USER_ERROR
    assert one_line(result.stderr) == (
        f"tune: error: cannot host the rendezvous on port {taken_port} ({flag}): address already in use by "
        f"another program or run on this machine; choose a free port (or leave {flag} out)"
    )
    assert tree.rank_files() == {}
    assert time.monotonic() - started < 60  # no wait for a timeout (the interpreter's start alone is slow here)


@pytest.mark.parametrize(
    ("flags", "env", "names"),
    [
        (["--rdzv_endpoint", "localhost:{port}"], {}, "(--rdzv_endpoint)"),
        (["--nnodes", "2", "--master_port", "{port}"], {}, "(--master_port)"),
        ([], {"PET_MASTER_PORT": "{port}"}, "(--master_port)"),  # torchrun's environment form of the flag
    ],
    ids=["static-endpoint", "two-nodes", "env"],
)
def test_a_taken_port_is_one_line_in_every_form(tune, tree, taken_port, monkeypatch, flags, env, names) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(port=taken_port))
    flags = [flag.format(port=taken_port) for flag in flags]
    result = tune("run", *flags, "--nproc_per_node", "1", "toy_distributed", "--config", "small")
    assert result.returncode == USER_ERROR
    line = one_line(result.stderr)
    assert line.startswith(f"tune: error: cannot host the rendezvous on port {taken_port} {names}: address already")
    assert tree.rank_files() == {}


def test_a_port_held_by_another_nodes_store_is_joined_not_refused(taken_port) -> None:
    from torch.distributed import TCPStore

    from toolkit.cli._run import _check_port_free, _Rendezvous, _store_answers

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    rendezvous = _Rendezvous("127.0.0.1", port, nodes=2, join_timeout_s=300, flags="--rdzv_endpoint")
    _check_port_free(rendezvous, hosted=True, port_flag="--rdzv_endpoint", might_share=True)  # no error
    assert _store_answers("127.0.0.1", port)
    assert not _store_answers("127.0.0.1", taken_port)  # a listener that is not a store
    del store


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rdzv_conf", "join_timeout=abc"],
         "--rdzv_conf join_timeout=abc: the time the nodes wait for each other must be a whole number of seconds "
         "above 0"),
        (["--nnodes", "2", "--rdzv_conf", "timeout=0"], "--rdzv_conf timeout=0: the time the nodes wait"),
        (["--rdzv_conf", "=3"], "--rdzv_conf '=3': The rendezvous configuration string must be in format"),
        (["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "--rdzv_conf", "is_host=maybe"],
         "--rdzv_conf is_host=maybe: The rendezvous configuration option 'is_host' does not represent a valid"),
        (["--rdzv_endpoint", "localhost"], "--rdzv_endpoint 'localhost' has no port: write HOST:PORT"),
        (["--rdzv_endpoint", "localhost:http"], "--rdzv_endpoint 'localhost:http': The port number of the"),
        (["--master_port", "99999"], "the rendezvous port 99999 is not a port number (1 to 65535)"),
    ],
    ids=["timeout-abc", "timeout-0", "conf-syntax", "is-host", "no-port", "port-word", "port-range"],
)
def test_bad_rendezvous_flags_are_one_line(tune, tree, flags: list[str], message: str) -> None:
    result = tune("run", *flags, "--nproc_per_node", "1", "toy_distributed", "--config", "small")
    assert result.returncode == USER_ERROR
    assert one_line(result.stderr).startswith(f"tune: error: {message}")
    assert tree.rank_files() == {}


def _launch_args(*flags: str) -> argparse.Namespace:
    from toolkit.cli._run import _torchrun_parser

    return _torchrun_parser().parse_args([*flags, "toy_distributed"])


def test_the_join_timeout_defaults_to_minutes_and_keeps_the_users() -> None:
    from toolkit.cli._run import _JOIN_TIMEOUT_S, _set_join_timeout

    static = _launch_args("--nnodes", "2")
    assert _set_join_timeout(static) == _JOIN_TIMEOUT_S < 600  # torchrun's own: ten minutes
    assert static.rdzv_conf == f"timeout={_JOIN_TIMEOUT_S}"  # the static rendezvous's name for it
    c10d = _launch_args("--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_conf", "is_host=1,join_timeout=900")
    assert _set_join_timeout(c10d) == 900
    assert c10d.rdzv_conf == "is_host=1,join_timeout=900"
    # c10d's name works for the static rendezvous too.
    static = _launch_args("--nnodes", "2", "--rdzv_conf", "join_timeout=7")
    assert _set_join_timeout(static) == 7 and "timeout=7" in static.rdzv_conf.split(",")


def _closing_line(result: subprocess.CompletedProcess) -> str:
    """The launch's last line, after asserting that the only other line is the notice that it waits."""
    lines = result.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("tune: waiting up to 3 s for the 2 nodes to meet at "), result.stderr
    return lines[1]


@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_a_node_that_never_comes_times_out_with_what_to_check(tree, backend: str) -> None:
    port = free_port()
    where = ["--master_port", str(port)] if backend == "static" else [
        "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"
    ]
    result = launch(tree, "--nnodes", "2", *where, "--rdzv_conf", "join_timeout=3", timeout_s=90)
    assert result.returncode == USER_ERROR
    line = _closing_line(result)
    flags = "--master_addr and --master_port" if backend == "static" else "--rdzv_endpoint"
    assert line.startswith(f"tune: error: not all 2 nodes joined the rendezvous at 127.0.0.1:{port} within 3 s")
    assert line.endswith(
        f": check that every node was started with the same --nnodes, {flags} and --rdzv_id, that 127.0.0.1 is "
        f"reachable from every node on port {port} (address, firewall), or wait longer with --rdzv_conf "
        f"join_timeout=SECONDS"
    )
    assert tree.rank_files() == {}


def test_a_node_that_cannot_reach_the_first_one_says_so(tree) -> None:
    port = free_port()  # nobody listens: node 0 was never started
    result = launch(tree, "--nnodes", "2", "--node_rank", "1", "--master_port", str(port), "--rdzv_conf",
                    "timeout=3", timeout_s=90)
    assert result.returncode == USER_ERROR
    line = _closing_line(result)  # and none of the store client's C++ logs of each attempt to connect
    assert line.startswith(f"tune: error: could not reach the rendezvous at 127.0.0.1:{port} (DistNetworkError: ")
    assert line.endswith(
        "check that the node hosting it was started, that --master_addr and --master_port give an address of it "
        f"that this node can reach, and that no firewall blocks port {port}"
    )


def test_more_processes_than_the_nodes_gpus_is_one_line_before_any_launch(tune, tree, monkeypatch) -> None:
    # tensor_parallel: 8 on a node of 4 GPUs without --nnodes used to pass validation (8 processes) and stop in
    # torch.cuda.set_device on ranks 4-7 after the launch.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    result = tune("run", "--nproc_per_node", "8", "toy_distributed", "--config", "small")
    assert result.returncode == USER_ERROR
    assert one_line(result.stderr) == (
        "tune: error: --nproc_per_node 8: this node has 4 GPU(s) and each process takes one (device: auto); start at "
        "most 4 per node (more GPUs for tensor_parallel or the other splits: --nnodes), or device=cpu for CPU "
        "processes")
    assert tree.rank_files() == {}


def test_cpu_processes_and_one_process_per_gpu_are_not_counted_against_the_gpus(monkeypatch) -> None:
    import torch

    from toolkit.cli._run import _check_gpus_per_node

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    _check_gpus_per_node(_launch_args("--nproc_per_node", "8"), device="cpu")
    _check_gpus_per_node(_launch_args("--nproc_per_node", "4"), device="cuda")
    _check_gpus_per_node(_launch_args("--nproc_per_node", "gpu"), device="auto")  # torchrun counts them itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _check_gpus_per_node(_launch_args("--nproc_per_node", "8"), device="auto")  # no GPU: CPU processes on gloo
