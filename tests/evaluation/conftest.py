"""What the lm-evaluation-harness tests share: the demo model at random weights, and tasks of a few documents
written as lm-eval YAML over local JSONL files (no network: the ``json`` dataset of ``datasets`` reads them)."""

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml

from toolkit.models.llama3 import llama3_demo
from toolkit.training import init_weights, materialize, set_seed

MAX_SEQ_LEN = 64  # the eval demo config's


def _random_demo_model(*, max_seq_len: int = MAX_SEQ_LEN) -> torch.nn.Module:
    set_seed(0)
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=max_seq_len)
    materialize(model, device=torch.device("cpu"))
    init_weights(model)
    return model.eval()


@pytest.fixture(scope="session")
def random_demo_model() -> Callable[..., torch.nn.Module]:
    """``random_demo_model(max_seq_len=64)``: the eval demo's model as the recipe builds it without a checkpoint
    (``checkpointer.checkpoint_dir=null``, seed 0)."""
    return _random_demo_model


@pytest.fixture
def demo_model() -> torch.nn.Module:
    """The eval demo's model at the demo config's size (max_seq_len 64), random from seed 0."""
    return _random_demo_model()


def _write_lm_eval_task(folder: Path, name: str, rows: list[dict], **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {
        "task": name,
        "dataset_path": "json",
        # datasets' cache for this file stays next to it.
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(folder / "datasets_cache")},
        "test_split": "test",
        **config,
    }
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return folder


@pytest.fixture(scope="session")
def write_lm_eval_task() -> Callable[..., Path]:
    """``write_lm_eval_task(folder, name, rows, **config)``: ``rows`` as JSONL and an lm-eval task YAML ``name``
    reading them (``config``: the task's other keys), both in ``folder`` (for ``lm_eval.include_path``), which
    it returns."""
    return _write_lm_eval_task
