"""What the training tests share: the one 4-process launch of :mod:`tests.training._tp_worker`, whose results
test_tensor_parallel.py, test_memory_tp.py and test_parallel_parity.py read (starting 4 processes on this 2-core
machine costs more than most of what they run, so they run once for all three), the one-process demo run
test_tensor_parallel.py and test_parallel_parity.py compare with, and the one 4-process launch of
:mod:`tests.training._ep_worker`, whose results test_expert_parallel.py and test_memory_ep.py read."""

from pathlib import Path

import pytest
import torch

from tests.launch import removing, run_recipe_here, run_workers


@pytest.fixture(scope="session")
def four_processes(tmp_path_factory) -> Path:
    """The folder the 4-process launch of :mod:`tests.training._tp_worker` wrote (its docstring lists what)."""
    out = tmp_path_factory.mktemp("four_processes")
    result = run_workers(Path(__file__).with_name("_tp_worker.py"), str(out), nproc=4, timeout_s=600,
                         clean_for_retry=removing(out))
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> Path:
    """The folder of the demo recipe on one process, in this process, uninterrupted: ``_tp_worker.RECIPE`` (the
    parity tests' ``COMMON``), saving step checkpoints at steps 2, 4 and 5 (saving changes nothing of the training)."""
    from tests.training._tp_worker import RECIPE, SAVES  # imported when needed, not for every test collected here

    out = tmp_path_factory.mktemp("one_process")
    run_recipe_here("full_finetune", "demo", *RECIPE, *SAVES, f"output_dir={out}")
    return out


@pytest.fixture(scope="session")
def ep_layouts(tmp_path_factory) -> dict:
    """What rank zero of the 4-process launch of :mod:`tests.training._ep_worker` saved (its docstring lists what)."""
    out = tmp_path_factory.mktemp("ep") / "results.pt"
    result = run_workers(Path(__file__).with_name("_ep_worker.py"), str(out), nproc=4, timeout_s=600,
                         clean_for_retry=removing(out))
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=True)
