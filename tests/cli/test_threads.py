"""The threads each CPU process of a run gets: an even share of the idle usable cores, the user's OMP_NUM_THREADS kept."""

from __future__ import annotations

import os

import pytest
import torch

import toolkit.cli._run as run_module
import toolkit.cli._threads as threads_module
from toolkit.cli._threads import choose_threads, usable_cores


@pytest.mark.parametrize(
    ("processes", "cores", "load", "threads", "busy"),
    [
        (1, 2, 0.0, 2, 0),  # an idle 2-core machine: both cores for the one process
        (2, 2, 0.1, 1, 0),  # two processes: one each
        (1, 2, 1.2, 1, 1),  # another process holds a core: one thread, not two spinning for it
        (1, 2, 9.0, 1, 1),  # however busy: at least one thread
        (4, 2, 0.0, 1, 0),  # more processes than cores: one each
        (2, 16, 3.6, 6, 3),  # 13 idle cores for 2 processes
        (2, 2, 0.9, 1, 0),  # the load a finished run leaves behind for a minute: no core busy
    ],
)
def test_each_process_gets_an_even_share_of_the_idle_cores(processes, cores, load, threads, busy) -> None:
    choice = choose_threads(processes, cores=cores, load=load)
    assert (choice.threads, choice.busy) == (threads, busy)


def test_a_containers_cpu_quota_limits_the_cores(tmp_path, monkeypatch) -> None:
    affinity = len(os.sched_getaffinity(0))
    quota = tmp_path / "cpu.max"
    monkeypatch.setattr(threads_module, "CGROUP_CPU_MAX", quota)
    quota.write_text("max 100000\n")  # no quota
    assert usable_cores() == affinity
    quota.write_text("50000 100000\n")  # half a CPU: one core
    assert usable_cores() == 1
    quota.write_text(f"{(affinity + 8) * 100000} 100000\n")  # a quota above the affinity: the affinity
    assert usable_cores() == affinity


def test_the_thread_count_leaves_the_demo_models_arithmetic_alone() -> None:
    """Why the count may follow the machine's load: a step's loss and gradients on one thread and on two are
    bitwise equal, so a run (or its resume) on a busy machine computes what it would on an idle one."""
    from omegaconf import OmegaConf

    from toolkit.config import instantiate

    cfg = OmegaConf.load(run_module.Path(__file__).resolve().parents[2] / "recipe_configs/full_finetune/demo.yaml")
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    tokens = torch.randint(0, 200, (8, 64))  # ids the demo vocabulary has
    saved, results = torch.get_num_threads(), []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            model.zero_grad()
            loss = model(tokens).float().logsumexp(-1).mean()
            loss.backward()
            results.append([loss.detach(), *(p.grad.clone() for p in model.parameters())])
    finally:
        torch.set_num_threads(saved)
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.fixture
def cpu_machine(monkeypatch):
    """A machine without GPUs of ``cores`` usable cores at a 1-minute ``load``, OMP_NUM_THREADS unset."""

    def make(*, cores: int, load: float) -> None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(threads_module, "usable_cores", lambda: cores)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))

    return make


def test_a_cpu_run_in_this_process_uses_the_idle_cores_and_gives_the_count_back(
    tune, tree, monkeypatch, cpu_machine
) -> None:
    cpu_machine(cores=4, load=2.2)
    seen = []
    monkeypatch.setattr(run_module, "_run_single_device", lambda path, argv: seen.append(torch.get_num_threads()) or 0)
    before = torch.get_num_threads()
    result = tune("run", "toy_single_device", "--config", "small")
    assert result.returncode == 0, result.stderr
    assert seen == [2]  # 4 cores, 2 busy
    assert torch.get_num_threads() == before
    assert result.stderr == ""  # the run's header says the count; the launch stays quiet
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's: torch's count is left as it is
    seen.clear()
    assert tune("run", "toy_single_device", "--config", "small").returncode == 0
    assert seen == [before]


def test_cpu_workers_inherit_the_count(tune, tree, monkeypatch, cpu_machine) -> None:
    import torch.distributed.run

    cpu_machine(cores=8, load=0.3)
    seen = []
    monkeypatch.setattr(torch.distributed.run, "run", lambda launch: seen.append(os.environ.get("OMP_NUM_THREADS")))
    result = tune("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small")
    assert result.returncode == 0, result.stderr
    assert seen == ["4"]
    assert "thread" not in result.stderr  # the run's header says the count; the launch stays quiet
    assert "OMP_NUM_THREADS" not in os.environ  # given to the workers only
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    seen.clear()
    result = tune("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small")
    assert seen == ["1"]
