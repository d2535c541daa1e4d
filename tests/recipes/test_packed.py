"""Packed data through the training recipe, where the attention mask is made on the device from ``input_pos``.

- Validation is a sum over every target token of the set, so packing its rows must not change it: the loss of a
  packed validation set equals that of the same conversations unpacked, at the same weights.
- Training on packed rows runs, and on CUDA FlexAttention (``flex_attention: auto``) trains like SDPA with the
  dense mask (a ``gpu`` test).
"""

import json
import random
from pathlib import Path

import pytest
import torch

from tests.launch import run_tune
from toolkit.data import chat_dataset
from toolkit.tokenizers import byte_tokenizer

STEPS = ["max_steps=4", "eval_every_n_steps=2", "save_every_n_steps=null", "~eval_tasks", "progress_bar=false",
         "batch_size=8", "micro_batch_size=4"]


def conversations(path: Path, n: int, seed: int) -> Path:
    rng = random.Random(seed)
    word = lambda: "".join(rng.choices("abcdefghij ", k=rng.randint(1, 20)))  # noqa: E731
    with path.open("w") as f:
        for i in range(n):
            turns = 2 if i % 3 == 0 else 1
            messages = [m for _ in range(turns)
                        for m in ({"role": "user", "content": word()}, {"role": "assistant", "content": word()})]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def chat(prefix: str, source: Path, *, packed: bool) -> list[str]:
    return [f"{prefix}._component_=toolkit.data.chat_dataset", f"{prefix}.source={source}", f"~{prefix}.split",
            f"~{prefix}.num_samples", f"~{prefix}.seed", f"{prefix}.cache_dir=null", f"{prefix}.packed={packed}",
            f"{prefix}.max_seq_len=64"]


def train(output_dir: Path, *overrides: str) -> list[dict]:
    result = run_tune("run", "full_finetune_single_device", "--config", "demo", f"output_dir={output_dir}",
                      *STEPS, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_packed_validation_equals_unpacked(tmp_path):
    source = conversations(tmp_path / "val.jsonl", 40, seed=1)
    common = ["dataset.num_samples=64", "device=cpu"]
    unpacked = train(tmp_path / "unpacked", *chat("validation_dataset", source, packed=False), *common)
    packed = train(tmp_path / "packed", *chat("validation_dataset", source, packed=True), *common)
    scores = [[(r["step"], r["val_loss"], r["val_tokens"]) for r in run if "val_loss" in r]
              for run in (unpacked, packed)]
    assert [s[0] for s in scores[0]] == [2, 4]
    # The same weights (the training data is the demo's, unpacked, in both runs) and the same target tokens; only
    # the batching differs, so the sums agree to float32 rounding (measured within 1e-8 relative).
    for (step, loss, tokens), (packed_step, packed_loss, packed_tokens) in zip(*scores):
        assert (step, tokens) == (packed_step, packed_tokens)
        assert packed_loss == pytest.approx(loss, rel=1e-6)
    options = dict(source=str(source), max_seq_len=64, cache_dir=None)
    assert len(chat_dataset(byte_tokenizer(), **options, packed=True)) < len(chat_dataset(byte_tokenizer(), **options))


def test_training_on_packed_rows(tmp_path):
    source = conversations(tmp_path / "train.jsonl", 200, seed=2)
    records = train(tmp_path / "run", *chat("dataset", source, packed=True), "device=cpu")
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 4 and all(0 < loss < 10 for loss in losses)
    assert losses[-1] < losses[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_attention_trains_like_the_dense_mask_on_cuda(tmp_path):
    # fp32 (the demo's dtype); the two kernels differ only in summation order, so after 4 steps at lr 3e-3 the
    # losses agree to about 1e-5 relative (1e-3 allowed: Adam's first steps amplify tiny gradient differences).
    source = conversations(tmp_path / "train.jsonl", 200, seed=2)
    common = [*chat("dataset", source, packed=True), *chat("validation_dataset", source, packed=True), "device=cuda"]
    runs = [train(tmp_path / name, *common, f"flex_attention={flag}")
            for name, flag in (("sdpa", False), ("flex", True))]
    for key in ("loss", "val_loss"):
        sdpa, flex = ([r[key] for r in run if key in r] for run in runs)
        assert flex == pytest.approx(sdpa, rel=1e-3), key
