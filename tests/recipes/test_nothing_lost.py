"""Nothing lost, ever: a finished run survives every bad input of a run that would replace it (overwrite=true), and
a write that fails (a full disk) stops with one line and leaves the previous complete checkpoint and export as they
were.

One finished demo run per recipe (4 steps, checkpoints at 2 and 4, and final/) is shared by the module; each test
runs `tune run` in this process (one device: no interpreter start, and faults can be injected) on a copy of it.
"""

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.checkpoint.test_output_dir import immutable, tree
from tests.checkpoint.test_write_failures import ENOSPC, fill_disk_in
from toolkit.cli.main import main as tune
from toolkit.checkpoint import hf as checkpointing

FAST = [
    "dataset.num_samples=64", "progress_bar=false", "~eval_tasks", "batch_size=4", "micro_batch_size=2",
    "max_steps=4", "save_every_n_steps=2", "keep_last_n=2",
]


def run(capfd, recipe: str, output_dir: Path, *overrides: str) -> tuple[int, list[str]]:
    """``tune run <recipe>_single_device --config demo`` here; its exit code and its stderr's lines."""
    capfd.readouterr()
    code = tune(["run", f"{recipe}_single_device", "--config", "demo", f"output_dir={output_dir}", *FAST, *overrides])
    return code, capfd.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("full") / "run"
    assert tune(["run", "full_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST]) == 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"] and (out / "final").is_dir()
    return out


@pytest.fixture(scope="module")
def finished_lora(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    assert tune(["run", "lora_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST]) == 0
    return out


@pytest.fixture
def old(finished, tmp_path) -> Path:
    """A copy of the finished run, for a test to try to replace."""
    return Path(shutil.copytree(finished, tmp_path / "old", symlinks=True))


def assert_refused(code: int, err: list[str], *named: str) -> None:
    assert code == 2, err
    assert len(err) == 1, err
    assert err[0].startswith("tune: error: "), err  # refused by the recipe, or by tune before it
    for text in named:
        assert text in err[0], err


BAD_INPUTS = {
    "a misspelled metric logger": (["metric_loggers=[{type: tensorbord}]"], "metric_loggers[0]: unknown type 'tensorbord'"),
    "an eval task typo": (
        ["eval_tasks={_component_: toolkit.data.demo_tasks, split: heldot, num_samples: 4}"], "'heldot'"
    ),
    "overwrite given as a string": (["overwrite=flase"], "overwrite: expects true or false, got 'flase'"),
}


@pytest.mark.parametrize("overrides, named", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_a_bad_input_leaves_the_old_run_as_it_was(old, capfd, overrides, named):
    before = tree(old)
    assert_refused(*run(capfd, "full_finetune", old, "overwrite=true", *overrides), named)
    assert tree(old) == before


def test_a_tracker_that_is_not_installed_leaves_the_old_run_as_it_was(old, capfd, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as if it were not installed
    before = tree(old)
    assert_refused(*run(capfd, "full_finetune", old, "overwrite=true", "metric_loggers=[wandb]"), '[wandb]"')
    assert tree(old) == before


def test_a_bad_clip_grad_norm_leaves_the_old_run_as_it_was(old, capfd):
    before = tree(old)
    assert_refused(*run(capfd, "full_finetune", old, "overwrite=true", "clip_grad_norm=abc"), "clip_grad_norm")
    assert tree(old) == before


def test_a_base_checkpoint_inside_the_old_run_is_never_cleared(old, capfd, tmp_path):
    before = tree(old)
    code, err = run(capfd, "full_finetune", old, "overwrite=true", f"checkpointer.checkpoint_dir={old / 'final'}")
    assert_refused(code, err, f"checkpointer.checkpoint_dir: {old / 'final'} is inside output_dir {old}")
    # A base exported into the run, reached through a link from elsewhere.
    link = tmp_path / "exported"
    link.symlink_to(old / "checkpoints" / "step_4", target_is_directory=True)
    code, err = run(capfd, "full_finetune", old, "overwrite=true", f"checkpointer.checkpoint_dir={link}")
    assert_refused(code, err, f"checkpointer.checkpoint_dir: {link} is inside output_dir")
    assert tree(old) == before


def test_a_folder_holding_what_is_not_a_run_is_never_cleared(old, capfd):
    (old / "notes.txt").write_text("the user's")
    before = tree(old)
    assert_refused(*run(capfd, "full_finetune", old, "overwrite=true"), f"{old} holds notes.txt, which is not a run's")
    assert tree(old) == before


def test_an_output_dir_that_is_a_file_or_read_only_is_one_line(old, capfd, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("x")
    assert_refused(*run(capfd, "full_finetune", file), f"output_dir: {file} is a file (ENOTDIR")
    assert_refused(*run(capfd, "full_finetune", file / "run"), f"{file} is a file (ENOTDIR")
    immutable(old)
    try:
        before = tree(old)
        assert_refused(*run(capfd, "full_finetune", old, "overwrite=true"), f"output_dir: cannot write into {old} (")
        assert tree(old) == before
    finally:
        subprocess.run(["chattr", "-i", str(old)])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_at_a_step_checkpoint_keeps_the_previous_ones(old, capfd, monkeypatch, async_save):
    # Resumed for 2 more steps with keep_last_n=1: step_6 fails to write, so nothing may be pruned.
    saved = {name: tree(old / name) for name in ("checkpoints", "final")}
    fill_disk_in(monkeypatch, "step_6")
    code, err = run(capfd, "full_finetune", old, "resume_from=auto", "max_steps=6", "keep_last_n=1",
                    f"async_save={str(async_save).lower()}")
    step_6, step_4 = old / "checkpoints" / "step_6", old / "checkpoints" / "step_4"
    assert_refused(code, err, f"{step_6}: cannot write the step checkpoint ({ENOSPC}); the newest complete one, "
                              f"{step_4}, is kept")
    assert {name: tree(old / name) for name in ("checkpoints", "final")} == saved
    # Once there is room, the same command resumes from step_4 and completes.
    monkeypatch.undo()
    code, err = run(capfd, "full_finetune", old, "resume_from=auto", "max_steps=6", "keep_last_n=1")
    assert code == 0, err
    assert sorted(p.name for p in (old / "checkpoints").iterdir()) == ["step_6"]


def test_a_full_disk_at_the_export_keeps_the_earlier_final(old, capfd, monkeypatch):
    final = tree(old / "final")

    def full(path, *args):
        path.write_bytes(bytes(100))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpointing, "write_safetensors", full)
    code, err = run(capfd, "full_finetune", old, "resume_from=auto", "max_steps=5", "save_every_n_steps=null")
    assert_refused(code, err, f"{old / 'final'}: cannot write the Hugging Face checkpoint ({ENOSPC}); the earlier one")
    assert tree(old / "final") == final
    assert not (old / ".final.partial").exists()


@pytest.mark.parametrize("overrides, named", [BAD_INPUTS["a misspelled metric logger"]])
def test_lora_a_bad_input_leaves_the_old_run_as_it_was(finished_lora, tmp_path, capfd, overrides, named):
    old = Path(shutil.copytree(finished_lora, tmp_path / "old", symlinks=True))
    before = tree(old)
    assert_refused(*run(capfd, "lora_finetune", old, "overwrite=true", *overrides), named)
    assert_refused(*run(capfd, "lora_finetune", old, "overwrite=true", f"checkpointer.checkpoint_dir={old}/final/merged"),
                   "checkpointer.checkpoint_dir")
    assert tree(old) == before


def test_eval_into_a_folder_it_cannot_write_stops_before_it_evaluates(finished, tmp_path, capfd):
    file = tmp_path / "a_file"
    file.write_text("x")
    capfd.readouterr()
    code = tune(["run", "eval", "--config", "demo", f"checkpointer.checkpoint_dir={finished / 'final'}",
                 f"output_dir={file / 'eval'}"])
    assert_refused(code, capfd.readouterr().err.strip().splitlines(), f"output_dir: {file / 'eval'} cannot be created")
    assert file.read_text() == "x"
