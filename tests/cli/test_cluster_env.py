"""tune run sets up NCCL and gloo for the workers: the interface that reaches the rendezvous host, the InfiniBand
devices, error handling and the flight recorder, each said once in one line and never over a value the user set; an
interface variable naming no interface of the node is one line before the launch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest

from tests.cli.conftest import TUNE_COMMAND, one_line, tune_env
from tests.launch import free_port
from tests.cli.test_launch_errors import USER_ERROR
from toolkit.cli import _cluster_env
from toolkit.cli._cluster_env import check_interface_names, interface_addresses, worker_environment
from toolkit.errors import UserError

# A node with a loopback, an Ethernet and an InfiniBand (IPoIB) interface.
INTERFACES = {"lo": {"127.0.0.1", "::1"}, "eth0": {"10.1.0.7"}, "ib0": {"192.168.50.7"}}
NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE"
}


@pytest.fixture
def node(monkeypatch, tmp_path):
    """This node: the interfaces above, routes to 192.168.50.x through ib0 and elsewhere through eth0, and a
    sysfs folder of InfiniBand devices (empty: none) that a test may fill."""
    monkeypatch.setattr(_cluster_env, "interface_addresses", lambda: INTERFACES)
    monkeypatch.setattr(
        _cluster_env, "route_source",
        lambda host, port: "127.0.0.1" if host in ("localhost", "127.0.0.1")
        else "192.168.50.7" if host.startswith("192.168.50.") else "10.1.0.7",
    )
    sysfs = tmp_path / "infiniband"
    sysfs.mkdir()
    monkeypatch.setattr(_cluster_env, "INFINIBAND_SYSFS", sysfs)
    return sysfs


def chosen(**kwargs) -> dict[str, str]:
    values: dict[str, str] = {}
    for group, _ in worker_environment(**{"rendezvous": None, "uses_gpus": True, "output_dir": None,
                                          "environ": {}, **kwargs}):
        assert not values.keys() & group.keys()  # each variable in one group, so said once
        values.update(group)
    return values


def test_several_nodes_use_the_interface_that_routes_to_the_rendezvous_host(node) -> None:
    groups = worker_environment(rendezvous=("192.168.50.1", 29400), uses_gpus=True, output_dir=None, environ={})
    assert groups[0] == (
        {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"},
        "network interface ib0 (192.168.50.7, the route to the rendezvous host 192.168.50.1): "
        "NCCL_SOCKET_IFNAME=ib0 and GLOO_SOCKET_IFNAME=ib0",
    )
    assert chosen(rendezvous=("node0.cluster", 29400))["GLOO_SOCKET_IFNAME"] == "eth0"
    # CPU processes talk over gloo alone: NCCL's variables are left as they are.
    assert chosen(rendezvous=("node0.cluster", 29400), uses_gpus=False) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_one_node_and_a_loopback_rendezvous_choose_no_interface(node) -> None:
    assert chosen(uses_gpus=False) == {}  # one node of CPU processes: the launch is as before
    assert chosen().keys() == NCCL_DEFAULTS - {"TORCH_FR_DUMP_TEMP_FILE"}  # no output_dir: torch's default place
    # Two "nodes" on this machine, or the host's own name resolving to 127.0.1.1: loopback says nothing of the
    # interface the other nodes use.
    assert chosen(rendezvous=("localhost", 29400), uses_gpus=False) == {}


def test_infiniband_devices_are_listed_for_nccl_and_none_is_nothing(node, monkeypatch) -> None:
    assert "NCCL_IB_HCA" not in chosen()
    for device in ("mlx5_1", "mlx5_0"):
        (node / device).mkdir()
    assert chosen()["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
    assert "NCCL_IB_HCA" not in chosen(uses_gpus=False)
    monkeypatch.setattr(_cluster_env, "INFINIBAND_SYSFS", node / "absent")  # a machine without the folder at all
    assert "NCCL_IB_HCA" not in chosen()


def test_errors_stop_the_process_and_the_flight_recorder_dumps_into_the_output_dir(node, tmp_path) -> None:
    values = chosen(output_dir=str(tmp_path / "run"))
    assert values["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # TearDown: a timeout stops the rank, torchrun sees it
    assert values["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert values["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert values["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl_trace_rank_")
    # A relative output_dir is the launcher's folder's, where the workers start too.
    assert chosen(output_dir="run")["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(os.getcwd(), "run", "nccl_trace_rank_")
    home = os.path.expanduser("~")
    assert chosen(output_dir="~/run")["TORCH_FR_DUMP_TEMP_FILE"] == os.path.join(home, "run", "nccl_trace_rank_")


@pytest.mark.parametrize(
    "user",
    [
        {"NCCL_SOCKET_IFNAME": "eth", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_IB_HCA": "mlx5_0",
         "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
         "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"},
        # The older names torch still reads for the same settings.
        {"NCCL_SOCKET_IFNAME": "", "GLOO_SOCKET_IFNAME": "", "NCCL_IB_HCA": "", "NCCL_ASYNC_ERROR_HANDLING": "1",
         "TORCH_NCCL_TRACE_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
         "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/fr_"},
    ],
    ids=["current names", "older names"],
)
def test_a_value_the_user_set_is_kept(node, tmp_path, user: dict[str, str]) -> None:
    (node / "mlx5_0").mkdir()
    (node / "mlx5_1").mkdir()
    assert worker_environment(rendezvous=("192.168.50.1", 29400), uses_gpus=True, output_dir=str(tmp_path),
                              environ=user) == []
    # One of the two interface variables set: only the other is chosen.
    values = chosen(rendezvous=("192.168.50.1", 29400), environ={"NCCL_SOCKET_IFNAME": "eth0"})
    assert values["GLOO_SOCKET_IFNAME"] == "ib0" and "NCCL_SOCKET_IFNAME" not in values


@pytest.mark.parametrize(
    "value",
    ["eth0", "eth", "=eth0", "ib0,eth0", "^docker,lo", "^eth9", "=lo"],
)
def test_interface_lists_that_match_an_interface_are_accepted(node, value: str) -> None:
    check_interface_names(uses_gpus=True, environ={"NCCL_SOCKET_IFNAME": value, "GLOO_SOCKET_IFNAME": value})


@pytest.mark.parametrize(
    ("environ", "entry"),
    [
        ({"NCCL_SOCKET_IFNAME": "eth9"}, "eth9"),
        ({"NCCL_SOCKET_IFNAME": "=eth"}, "=eth"),  # '=': an exact name, not a prefix
        ({"GLOO_SOCKET_IFNAME": "eth0,enp3s0"}, "enp3s0"),
    ],
)
def test_an_interface_name_that_matches_none_is_refused(node, environ: dict[str, str], entry: str) -> None:
    ((variable, value),) = environ.items()
    with pytest.raises(UserError) as raised:
        check_interface_names(uses_gpus=True, environ=environ)
    assert str(raised.value) == (
        f"{variable}={value}: '{entry}' names no network interface of node {socket.gethostname()} (it has eth0, ib0, "
        "lo); name one of those, or unset it to let tune choose the one that reaches the rendezvous host"
    )


def test_nccls_interface_is_not_checked_for_cpu_processes(node) -> None:
    check_interface_names(uses_gpus=False, environ={"NCCL_SOCKET_IFNAME": "eth9"})  # gloo ignores it


def test_this_machines_interfaces_are_read_without_extra_packages() -> None:
    addresses = interface_addresses()
    assert "127.0.0.1" in addresses.get("lo", set())  # Linux: the loopback interface, by SIOCGIFADDR
    routed = _cluster_env.route_source("127.0.0.1", 29400)
    assert routed == "127.0.0.1"
    assert _cluster_env.route_source("no-such-host.invalid", 29400) is None


def test_a_wrong_interface_stops_tune_run_before_any_process_starts(tune, tree, node, monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    result = tune("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small")
    assert result.returncode == USER_ERROR
    assert one_line(result.stderr).startswith("tune: error: GLOO_SOCKET_IFNAME=eth9: 'eth9' names no network ")
    assert tree.rank_files() == {}


def test_tune_run_says_each_choice_once_and_the_workers_inherit_it(tune, tree, node, monkeypatch) -> None:
    import torch
    import torch.distributed.run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's: kept, and not said
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    seen: list[dict[str, str | None]] = []
    names = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE",
             "TORCH_NCCL_DUMP_ON_TIMEOUT", "NCCL_IB_HCA")
    # torchrun's entry point, where the workers would start with this process's environment.
    monkeypatch.setattr(torch.distributed.run, "run", lambda launch: seen.append({n: os.environ.get(n) for n in names}))
    result = tune("run", "--nnodes", "2", "--node_rank", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                  "192.168.50.1:29400", "--nproc_per_node", "2", "toy_distributed", "--config", "small")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[:3] == [
        "tune: network interface ib0 (192.168.50.7, the route to the rendezvous host 192.168.50.1): "
        "NCCL_SOCKET_IFNAME=ib0 and GLOO_SOCKET_IFNAME=ib0",
        "tune: a timed-out NCCL collective stops its process: TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "tune: NCCL flight recorder on: TORCH_FR_BUFFER_SIZE=2000",
    ]
    assert seen == [{"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                     "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "NCCL_IB_HCA": None}]
    # This process's environment is as it was: a later launch in it chooses again.
    assert "GLOO_SOCKET_IFNAME" not in os.environ and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


# Writes the interface variables it was started with to out_dir/rank_<RANK>.txt.
ENV_RECIPE = '''\
"""Toy recipe: what the launcher set for gloo."""
import os

from toolkit.config import recipe_main


@recipe_main
def main(cfg):
    with open(os.path.join(cfg.out_dir, f"rank_{os.environ['RANK']}.txt"), "w") as f:
        f.write(f"{os.environ.get('GLOO_SOCKET_IFNAME')} {os.environ.get('NCCL_SOCKET_IFNAME')}")


if __name__ == "__main__":
    main()
'''


def _routable_address() -> tuple[str, str] | None:
    """An interface of this machine with a non-loopback IPv4 address, and that address."""
    for name, addresses in sorted(interface_addresses().items()):
        for address in sorted(addresses):
            if ":" not in address and not address.startswith("127."):
                return name, address
    return None


def test_two_nodes_at_a_non_loopback_address_get_its_interface_for_gloo(tree) -> None:
    # Two launchers on this machine meeting at its own non-loopback address, as two nodes meet at the first one's:
    # the workers inherit GLOO_SOCKET_IFNAME (CPU processes: NCCL's is left alone) and gloo connects through it.
    found = _routable_address()
    if found is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    interface, address = found
    (tree.recipes / "envtoy.py").write_text(ENV_RECIPE)
    (tree.configs / "envtoy").mkdir()
    (tree.configs / "envtoy" / "small.yaml").write_text(f"out_dir: {tree.out}\n")
    env = {**tune_env(tree), "OMP_NUM_THREADS": "1"}
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(name, None)
    port = free_port()
    launchers = [
        subprocess.Popen(
            [*TUNE_COMMAND, "run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"{address}:{port}", "--rdzv_conf", f"is_host={is_host},join_timeout=60",
             "envtoy_distributed", "--config", "small"],
            cwd=tree.work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )
        for is_host in (1, 0)
    ]
    try:
        results = [launcher.communicate(timeout=150) for launcher in launchers]
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
    for launcher, (_, err) in zip(launchers, results):
        assert launcher.returncode == 0, err
        lines = [line for line in err.splitlines() if line.startswith("tune: network interface")]
        assert lines == [f"tune: network interface {interface} ({address}, the route to the rendezvous host "
                         f"{address}): GLOO_SOCKET_IFNAME={interface}"]
    assert tree.rank_files() == {"rank_0.txt": f"{interface} None", "rank_1.txt": f"{interface} None"}
