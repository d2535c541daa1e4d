"""fp16-mixed: loss scaling skips the same steps on any number of processes (promise 1), also across a resume on
another number, and the recipes' fused AdamW is not used with FSDP2's sharded loss scaler, which it cannot step
with."""

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.launch import as_in_a_subprocess, run_workers
from toolkit.errors import UserError
from toolkit.data import GlobalBatchSampler
from toolkit.training import StepCheckpointer, TrainingState, fused_by_default
from toolkit.training.step import make_grad_scaler

WORKER = Path(__file__).parent / "_fp16_worker.py"


def run_worker_here(out: Path) -> None:
    """The worker's ``main`` on 1 process, in this one (no launch): one torch thread, as torchrun's worker has
    (OMP_NUM_THREADS=1); without a process group, which on 1 process reduces over nothing, and the model is not
    wrapped on 1 process either way."""
    sys.path.insert(0, str(WORKER.parent))
    try:
        from _fp16_worker import main

        with as_in_a_subprocess():
            main(str(out))
    finally:
        sys.path.remove(str(WORKER.parent))


def test_the_scale_starts_divided_by_the_data_parallel_size():
    # Each rank's loss is multiplied by the data-parallel size (the reduction averages): the scale makes up for it.
    cpu = torch.device("cpu")
    assert make_grad_scaler(enabled=True, device=cpu, sharded=False).get_scale() == 2.0**16
    assert make_grad_scaler(enabled=True, device=cpu, sharded=False, data_parallel_size=4).get_scale() == 2.0**14
    assert make_grad_scaler(enabled=False, device=cpu, sharded=False) is None


def test_overflowing_steps_are_skipped_alike_on_one_and_two_processes(tmp_path):
    # From a scale at which the first steps overflow: before the scale was divided by the world size, 2 processes
    # overflowed one step more than 1 (their backward carries values twice as large) and ended with other weights.
    run_worker_here(tmp_path / "1.json")
    result = run_workers(WORKER, str(tmp_path / "2.json"), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{nproc}.json").read_text()) for nproc in (1, 2))
    assert [r["skipped"] for r in one] == [r["skipped"] for r in two]
    assert any(r["skipped"] for r in one) and not all(r["skipped"] for r in one)  # the test can tell
    # The same fp16 arithmetic summed in another order (micro-batches, the all-reduce): equal to fp16 rounding of
    # the gradients, which Adam's normalized update keeps small (measured: equal to 7 digits).
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["weights"] == pytest.approx(a["weights"], rel=1e-5)


def test_fused_adam_is_not_the_default_with_the_sharded_scaler():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    sharded = ShardedGradScaler("cpu")
    adamw = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-3})
    assert fused_by_default(adamw, grad_scaler=sharded) == adamw
    assert fused_by_default(adamw, grad_scaler=torch.amp.GradScaler("cpu")) == {**adamw, "fused": True}
    with pytest.raises(UserError, match="optimizer.fused=false"):
        fused_by_default(OmegaConf.create({**adamw, "fused": True}), grad_scaler=sharded)
    kept = OmegaConf.create({**adamw, "fused": False})
    assert fused_by_default(kept, grad_scaler=sharded) == kept



def test_a_resume_on_another_world_size_keeps_the_effective_scale(tmp_path):
    def state(world_size: int) -> TrainingState:
        model = torch.nn.Linear(4, 4)
        optimizer = torch.optim.AdamW(model.parameters())
        scaler = make_grad_scaler(
            enabled=True, device=torch.device("cpu"), sharded=False, data_parallel_size=world_size
        )
        return TrainingState(
            model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
            GlobalBatchSampler(8, global_batch_size=4), scaler,
        )

    cfg = OmegaConf.create({"model": {}})
    saved = state(world_size=1)
    saved.grad_scaler.load_state_dict({**saved.grad_scaler.state_dict(), "scale": 2.0**10})  # backed off a while
    step = StepCheckpointer(tmp_path, every_n_steps=1).save(1, saved, config=cfg)
    resumed = state(world_size=2)
    # Loading as a rank of a 2-process run would (the file layout is the same): 2 data-parallel ranks.
    checkpoints = StepCheckpointer(tmp_path, every_n_steps=1, data_parallel_size=2)
    checkpoints.world_size = 2
    checkpoints.load(step, resumed, config=cfg)
    assert resumed.grad_scaler.get_scale() == 2.0**9  # scale x world size unchanged: 2**10 x 1 = 2**9 x 2
