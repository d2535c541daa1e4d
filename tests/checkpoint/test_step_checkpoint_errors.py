"""A damaged step checkpoint given to resume from stops with one line naming it (exit 2), never a traceback."""

import shutil
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from tests.launch import run_tune, run_tune_here
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
    def tune(output_dir, *overrides, run=partial(run_tune, timeout_s=120)):
        return run("run", "full_finetune_single_device", "--config", "demo", f"output_dir={output_dir}", *FAST,
                   *overrides)

    # The checkpoint is made in this process (the same command); the refusal is `tune run` end to end.
    first = tune(tmp_path / "first", "max_steps=3", run=run_tune_here)
    assert first.returncode == 0, first.stderr[-2000:]
    damaged = tmp_path / "damaged" / "checkpoints" / "step_3"
    shutil.copytree(tmp_path / "first" / "checkpoints" / "step_3", damaged)
    zero_in_place(damaged / "__0_0.distcp")

    result = tune(tmp_path / "second", "max_steps=6", f"resume_from={damaged}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0, result.stderr[-2000:]
    assert f"{damaged}: cannot read the checkpoint" in result.stderr
    assert not (tmp_path / "second" / "metrics.jsonl").exists()


# --- the base's config.json and tokenizer files, kept in every checkpoint for export ---------------------------------


def test_every_checkpoint_keeps_the_base_files_with_async_saves_pruning_and_resume(tmp_path, caplog, monkeypatch):
    from toolkit.checkpoint import step_writer as step_checkpoint

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"bos_token_id": 5}')
    (base / "tokenizer.json").write_text('{"model": {}}')
    (base / "tokenizer.model").write_bytes(bytes(2000))  # over the limit below: left out, and said so
    (base / "model.safetensors").write_bytes(bytes(100))  # weights: never copied
    monkeypatch.setattr(step_checkpoint, "MAX_BASE_FILE_BYTES", 1000)
    cfg = OmegaConf.create({"model": {"in_features": 4, "out_features": 3}})
    checkpoints = StepCheckpointer(tmp_path / "run", every_n_steps=1, keep_last_n=2, async_save=True, base_checkpoint=base)
    state = training_state(0)
    for step in (1, 2, 3):
        path = checkpoints.save(step, state, config=cfg)
    checkpoints.wait()
    # The checkpointer's records only: pytest 9's caplog also holds torch's own DEBUG records.
    (too_large,) = [r.getMessage() for r in caplog.records if r.name == step_checkpoint.log.name]
    assert f"{base / 'tokenizer.model'}: 0 MB, too large" in too_large and "\n" not in too_large
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [".base_files", "step_2", "step_3"]
    for step in ("step_2", "step_3"):
        kept = root / step / "base_files"
        assert sorted(p.name for p in kept.iterdir()) == ["config.json", "tokenizer.json"]
        assert (kept / "config.json").read_text() == '{"bos_token_id": 5}'
    assert (root / "step_3" / "base_files" / "tokenizer.json").stat().st_nlink == 3, "hard links, not copies"
    # Resuming reads none of it, and a new run's first save copies the base afresh (older checkpoints keep theirs).
    resumed = training_state(1)
    assert StepCheckpointer(tmp_path / "run", every_n_steps=1).load(path, resumed, config=cfg) == 3
    assert torch.equal(resumed.model.weight, state.model.weight)
    (base / "config.json").write_text('{"bos_token_id": 8}')
    again = StepCheckpointer(tmp_path / "run", every_n_steps=1, base_checkpoint=base).save(4, resumed, config=cfg)
    assert (again / "base_files" / "config.json").read_text() == '{"bos_token_id": 8}'
    assert (root / "step_3" / "base_files" / "config.json").read_text() == '{"bos_token_id": 5}'


def test_a_run_started_from_a_step_checkpoint_keeps_that_checkpoints_base_files(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer_config.json").write_text("{}")
    cfg = OmegaConf.create({"model": {"in_features": 4, "out_features": 3}})
    first = StepCheckpointer(tmp_path / "first", every_n_steps=1, base_checkpoint=base).save(1, training_state(0), config=cfg)
    second = StepCheckpointer(tmp_path / "second", every_n_steps=1, base_checkpoint=first).save(
        1, training_state(0), config=cfg
    )
    assert [p.name for p in (second / "base_files").iterdir()] == ["tokenizer_config.json"]


def test_a_base_without_such_files_adds_no_folder(tmp_path):
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "params.json").write_text("{}")
    cfg = OmegaConf.create({"model": {"in_features": 4, "out_features": 3}})
    step = StepCheckpointer(tmp_path / "run", every_n_steps=1, base_checkpoint=tmp_path / "meta").save(
        1, training_state(0), config=cfg
    )
    assert sorted(p.name for p in step.parent.iterdir()) == ["step_1"] and not (step / "base_files").exists()
