"""What the recipe tests of a family's tiny Hugging Face checkpoint share (``test_phi3_recipes.py``,
``test_gemma3_recipes.py``): short fp32 runs of the ``any_model`` configs, the check that a run trained, and the
check that a checkpoint with a feature the builder does not compute stops in one line."""

import json
from collections.abc import Callable
from pathlib import Path

import torch

from tests.launch import run_tune_here

STEPS = 6
FAST = [
    f"max_steps={STEPS}", "dataset.num_samples=64", "batch_size=8", "micro_batch_size=4", "data_parallel=ddp",
    "progress_bar=false", "~eval_tasks", "save_every_n_steps=null", "dtype=fp32", "max_seq_len=64",
    "log_every_n_steps=1",
]


def losses(out: Path) -> list[float]:
    """The loss of each step a run in ``out`` logged."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [record["loss"] for record in map(json.loads, lines) if "loss" in record]


def check_trained(out: Path) -> None:
    """The run in ``out`` made its ``STEPS`` steps with finite losses, the last below the first."""
    run_losses = losses(out)
    assert len(run_losses) == STEPS and all(torch.isfinite(torch.tensor(run_losses))), run_losses
    assert run_losses[-1] < run_losses[0], run_losses


def refusal(source: Path, files: tuple[str, ...], edit: Callable[[dict], None], tmp_path: Path) -> str:
    """A full fine-tune of ``source``'s ``files`` (linked) with its ``config.json`` changed by ``edit``: it must exit
    with 2 and write nothing; returns the one line it printed (which names the config.json)."""
    folder = tmp_path / "edited"
    folder.mkdir()
    for name in files:
        (folder / name).symlink_to(source / name)
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "run"
    result = run_tune_here("run", "full_finetune_single_device", "--config", "any_model", f"output_dir={out}",
                           f"checkpointer.checkpoint_dir={folder}", *FAST)
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert str(folder / "config.json") in line, line
    assert not out.exists()
    return line
