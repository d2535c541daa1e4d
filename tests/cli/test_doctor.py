"""tune doctor: each check on made-up facts, the command on this machine, a group of CPU processes measuring
their collectives, and the bad inputs that stop it with one line."""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch import free_port
from toolkit.cli import doctor
from toolkit.cli._doctor_worker import bus_bandwidth, slowest
from toolkit.cli.doctor import FAIL, GIB, OK, WARN, Row

REPO = Path(__file__).resolve().parents[2]
TUNE_DOCTOR = [sys.executable, "-m", "toolkit.cli.main", "doctor"]
_DROPPED_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_ERROR_FILE", "TUNE_VERBOSE"}
_RISKY = {v.name for v in doctor.RISKY_VARIABLES} | {"NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without a launcher's variables or any the doctor flags, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if k not in _DROPPED_ENV | _RISKY and not k.startswith("PET_")
    }
    return {**env, "PYTHONPATH": str(REPO), **(extra or {})}


def tune_doctor(*args: str, env: dict[str, str] | None = None, timeout_s: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([*TUNE_DOCTOR, *args], capture_output=True, text=True, timeout=timeout_s, env=_env(env),
                          check=False)


def _row(output: str, check: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(check + " "))


# --- the checks, each on made-up facts ------------------------------------------------------------------------------


def test_shm_below_one_gib_warns_with_the_docker_fix() -> None:
    assert doctor.check_shm(64 * 1024**2).verdict == WARN
    assert "--shm-size" in doctor.check_shm(64 * 1024**2).fix
    assert doctor.check_shm(16 * GIB).verdict == OK
    assert doctor.check_shm(None).verdict == WARN


def test_memlock_limit_warns_only_with_infiniband() -> None:
    assert doctor.check_memlock(64 * 1024, ["mlx5_0"]).verdict == WARN
    assert "ulimit -l unlimited" in doctor.check_memlock(64 * 1024, ["mlx5_0"]).fix
    assert doctor.check_memlock(64 * 1024, []).verdict == OK
    assert doctor.check_memlock(resource.RLIM_INFINITY, ["mlx5_0"]).verdict == OK


def test_environment_flags_each_risky_variable_with_its_fix() -> None:
    rows = doctor.check_environment(
        {"NCCL_P2P_DISABLE": "1", "NCCL_DEBUG": "trace", "NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "",
         "NCCL_IB_DISABLE": "1", "CUDA_LAUNCH_BLOCKING": "0"},
        ["eth0", "lo"], [],
    )
    flagged = {row.check: row for row in rows}
    assert set(flagged) == {"env NCCL_P2P_DISABLE", "env NCCL_DEBUG", "env NCCL_ALGO", "env CUDA_VISIBLE_DEVICES"}
    assert all(row.verdict == WARN and row.fix for row in rows)
    # NCCL_IB_DISABLE matters only where there is InfiniBand to disable.
    rows = doctor.check_environment({"NCCL_IB_DISABLE": "1"}, ["eth0"], ["mlx5_0"])
    assert [row.check for row in rows] == ["env NCCL_IB_DISABLE"]
    assert doctor.check_environment({"PATH": "/bin"}, ["eth0"], [])[0].verdict == OK


def test_an_interface_variable_naming_no_interface_fails() -> None:
    rows = doctor.check_environment({"NCCL_SOCKET_IFNAME": "doesnotexist0", "GLOO_SOCKET_IFNAME": "eth0"},
                                    ["eth0", "lo"], [])
    assert [(row.check, row.verdict) for row in rows] == [("env NCCL_SOCKET_IFNAME", FAIL)]
    assert "doesnotexist0" in rows[0].found and "eth0, lo" in rows[0].found
    assert doctor.check_environment({"NCCL_SOCKET_IFNAME": "^lo,docker"}, ["eth0", "lo"], [])[0].verdict == OK


def test_versions_gpus_links_and_disk() -> None:
    assert doctor.check_python((3, 9, 1)).verdict == FAIL
    assert doctor.check_cuda(None, 0).verdict == OK
    assert doctor.check_cuda("12.8", 0).verdict == WARN  # a CUDA build that sees no GPU
    assert doctor.check_nccl((2, 27, 3)).found == "2.27.3"
    assert doctor.check_driver(None, 0).verdict == OK
    assert doctor.check_driver(None, 2).verdict == WARN
    assert doctor.check_gpus(["H100", "H100"]).found == "2: 2 x H100"
    topology = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV18\tSYS\t0-31\t0\n"
        "GPU1\tNV18\t X \tSYS\t0-31\t0\n"
        "GPU2\tSYS\tSYS\t X \t32-63\t1\n"
    )
    links = doctor.check_gpu_links(topology, 3)
    assert links.verdict == WARN and links.found == "not NVLink: GPU0-GPU2 SYS, GPU1-GPU2 SYS"
    assert doctor.check_gpu_links(topology.replace("SYS", "NV12"), 3).verdict == OK
    assert doctor.check_gpu_links(None, 1).verdict == OK
    assert doctor.check_disk(5 * GIB, "/out").verdict == WARN and "5.0 GiB" in doctor.check_disk(5 * GIB, "/out").found
    assert doctor.check_disk(500 * GIB, "/out").verdict == OK
    assert doctor.check_network({"lo": {"127.0.0.1"}}).verdict == WARN
    assert doctor.check_network({"lo": {"127.0.0.1"}, "eth0": {"10.0.0.2"}}).verdict == OK


def test_combine_fails_a_version_that_differs_and_names_where() -> None:
    node0 = [doctor.check_torch("2.13.0"), doctor.check_shm(16 * GIB)]
    node1 = [doctor.check_torch("2.12.0"), doctor.check_shm(GIB // 2)]
    rows = {row.check: row for row in doctor.combine([("a", node0), ("b", node1)])}
    assert rows["torch"].verdict == FAIL
    assert "2.13.0 on a rank 0" in rows["torch"].found and "2.12.0 on b rank 1" in rows["torch"].found
    assert rows["/dev/shm"].verdict == WARN and "(on b rank 1)" in rows["/dev/shm"].found
    same = doctor.combine([("a", node0), ("a", node0)])
    assert same == node0 and doctor.exit_code(same) == 0


def test_bus_bandwidth_as_nccl_tests_defines_it() -> None:
    assert bus_bandwidth("all_reduce", 1000, 1.0, 4) == pytest.approx(1500)
    assert bus_bandwidth("all_gather", 1000, 1.0, 4) == pytest.approx(750)


def test_slowest_rank_is_named_only_when_well_above_the_others() -> None:
    row = slowest([0.01, 0.011, 0.05, 0.012], ["a", "a", "b", "b"], "work")
    assert row.verdict == WARN and row.found.startswith("rank 2 on b")
    assert slowest([0.01, 0.012, 0.013], ["a"] * 3, "work").verdict == OK
    assert slowest([0.01], ["a"], "work").verdict == OK


def test_table_columns() -> None:
    table = doctor.checks_table([Row("torch", OK, "2.13"), Row("env X", WARN, "X=1: slow", "unset X")])
    assert table.splitlines() == [
        "CHECK  VERDICT  FOUND      FIX",
        "torch  ok       2.13",
        "env X  warn     X=1: slow  unset X",
    ]


# --- the command ----------------------------------------------------------------------------------------------------


def test_doctor_on_this_machine_prints_the_table_and_exits_0(tmp_path: Path) -> None:
    result = tune_doctor("--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split() == ["CHECK", "VERDICT", "FOUND", "FIX"]
    for check in ("python", "torch", "cuda", "nccl", "driver", "gpus", "network", "infiniband", "/dev/shm",
                  "locked memory", "environment", "disk"):
        assert re.search(rf"^{re.escape(check)} +(ok|warn) ", result.stdout, flags=re.MULTILINE), check


def test_planted_variables_are_flagged_and_a_missing_interface_fails() -> None:
    result = tune_doctor(env={"NCCL_P2P_DISABLE": "1", "NCCL_SOCKET_IFNAME": "doesnotexist0"})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "unset NCCL_P2P_DISABLE" in _row(result.stdout, "env NCCL_P2P_DISABLE")
    row = _row(result.stdout, "env NCCL_SOCKET_IFNAME")
    assert " fail " in row and "doesnotexist0" in row and "unset NCCL_SOCKET_IFNAME" in row


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--nproc_per_node", "0"], "--nproc_per_node must be at least 1, got 0"),
        (["--nproc_per_node", "-2"], "got -2"),
        (["--nnodes", "2", "--node_rank", "0"], "--rdzv_endpoint"),
        (["--nnodes", "2", "--node_rank", "2", "--rdzv_endpoint", "127.0.0.1:1"], "--node_rank 2"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--rdzv_endpoint", "nohost.invalid:29400"], "nohost.invalid"),
        (["--nproc_per_node", "1", "--nnodes", "2", "--rdzv_endpoint", "127.0.0.1:port"], "127.0.0.1:port"),
        (["--output_dir", "/no/such/folder"], "/no/such/folder"),
    ],
    ids=["nproc-0", "nproc-negative", "no-endpoint", "node-rank", "unresolvable", "bad-port", "output-dir"],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], named: str) -> None:
    result = tune_doctor(*args, timeout_s=30)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and named in lines[0], result.stderr


def test_several_processes_refuse_a_missing_interface_before_launching() -> None:
    result = tune_doctor("--nproc_per_node", "2", env={"GLOO_SOCKET_IFNAME": "doesnotexist0"}, timeout_s=30)
    assert result.returncode == 2 and "doesnotexist0" in result.stderr and result.stderr.count("\n") == 1


def test_two_processes_measure_bandwidth_and_name_the_slow_rank() -> None:
    result = tune_doctor("--nproc_per_node", "2", env={"TUNE_DOCTOR_TEST_SLOW_RANK": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    for collective in ("all_reduce", "all_gather"):
        line = rf"^{collective} +\d+ [KM]iB +[\d.]+ ms +([\d.]+) [MG]B/s$"
        rates = re.findall(line, result.stdout, flags=re.MULTILINE)
        assert len(rates) == 4 and all(float(rate) > 0 for rate in rates), result.stdout
    row = _row(result.stdout, "slowest rank (local workload)")
    assert " warn " in row and "rank 1 on " in row, result.stdout
    assert "backend gloo" in result.stdout and "verdict: warn" in result.stdout


def test_two_nodes_with_different_torch_versions_fail_naming_the_node() -> None:
    # Two "nodes" of two processes each, on loopback.
    port = free_port()
    flags = ["--nnodes", "2", "--nproc_per_node", "2", "--rdzv_endpoint", f"127.0.0.1:{port}", "--timeout_s", "60"]
    nodes = [
        subprocess.Popen([*TUNE_DOCTOR, *flags, "--node_rank", str(rank)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=_env({"TUNE_TEST_FAKE_TORCH_VERSION": "2.0.0"} if rank == 1 else None))
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 1, out + err
        row = _row(out, "torch")
        assert " fail " in row and "2.0.0 on " in row and "differs" in row, out
