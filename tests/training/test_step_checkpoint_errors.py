"""A damaged step checkpoint given to resume from stops with one line naming it (exit 2), never a traceback."""

import shutil

import pytest
import torch
from omegaconf import OmegaConf

from tests.launch import run_tune
from toolkit.data import GlobalBatchSampler
from toolkit.errors import UserError
from toolkit.training import StepCheckpointer, TrainingState

FAST = [
    "dataset.num_samples=64", "progress_bar=false", "~eval_tasks", "batch_size=4", "micro_batch_size=2",
    "save_every_n_steps=3",
]


def zero_in_place(file):
    """Same size, unreadable content: the size check passes, and DCP's read fails with a CheckpointException (a
    BaseException, not an Exception)."""
    file.write_bytes(bytes(file.stat().st_size))


def training_state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    return TrainingState(
        model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        GlobalBatchSampler(8, global_batch_size=4),
    )


def test_load_names_a_corrupt_shard_as_a_user_error(tmp_path):
    cfg = OmegaConf.create({"model": {"in_features": 4, "out_features": 3}})
    checkpoints = StepCheckpointer(tmp_path, every_n_steps=1)
    saved = training_state(0)
    saved.model(torch.ones(2, 4)).sum().backward()
    saved.optimizer.step()
    step = checkpoints.save(1, saved, config=cfg)
    loaded = training_state(1)
    assert checkpoints.load(step, loaded, config=cfg) == 1
    assert torch.equal(loaded.model.weight, saved.model.weight)

    zero_in_place(next(step.glob("*.distcp")))
    with pytest.raises(UserError, match=f"{step}: cannot read the checkpoint .*; a file may be corrupt"):
        checkpoints.load(step, training_state(1), config=cfg)


def test_resume_from_a_corrupt_checkpoint_is_one_line_and_exit_2(tmp_path):
    def tune(output_dir, *overrides):
        return run_tune(
            "run", "full_finetune_single_device", "--config", "demo", f"output_dir={output_dir}", *FAST, *overrides,
            timeout_s=120,
        )

    first = tune(tmp_path / "first", "max_steps=3")
    assert first.returncode == 0, first.stderr[-2000:]
    damaged = tmp_path / "damaged" / "checkpoints" / "step_3"
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step_3", damaged)
    zero_in_place(damaged / "__0_0.distcp")

    result = tune(tmp_path / "second", "max_steps=6", f"resume_from={damaged}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0, result.stderr[-2000:]
    assert f"{damaged}: cannot read the checkpoint" in result.stderr
    assert not (tmp_path / "second" / "metrics.jsonl").exists()
