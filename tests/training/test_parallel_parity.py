"""Promise 1: the same global batch trains the same model, whatever the processes, accumulation and strategy.

Every run uses the demo's samples with variable-length words, a global batch of 8 and 5 optimizer steps. fp32 on CPU: the
runs differ only in the order in which gradient sums are reduced, so losses agree to ~1e-7 relative; we allow
1e-5. Weights after 5 Adam steps are compared at 1e-4 relative: Adam divides by sqrt(v), which turns rounding-level
gradient differences on tiny-gradient entries into larger relative update differences.

The 1-process runs go through `tune run` in the test's own process; the 2-process runs share one launch
(``two_process_runs``); HSDP on 4 processes is a run in the 4-process launch the training tests share (conftest.py's
``four_processes``, tests/training/_tp_worker.py).
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune_here
from tests.training import _tp_worker as tp_worker
from toolkit.data import GlobalBatchSampler, demo_dataset, padded_collate
from toolkit.models.llama3 import llama3_demo
from toolkit.tokenizers import byte_tokenizer
from toolkit.training import init_weights, materialize, set_seed

# Words of 2 to 8 letters: samples hold different numbers of trained tokens, so normalization matters. One list
# with the tensor-parallel tests, whose shared 4-process launch runs the HSDP case below with it.
COMMON = tp_worker.RECIPE


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def run(out: Path, *args: str) -> list[float]:
    """`tune run` on one process, in this process."""
    result = run_tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={out}", *COMMON,
                           *args)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(out)


@pytest.fixture(scope="module")
def reference(one_process) -> tuple[list[float], dict]:
    """One process, 4 micro-steps of 2 per optimizer step (conftest.py's run, shared with the tensor-parallel
    tests): its losses and final weights."""
    return losses(one_process), load_file(one_process / "final" / "model.safetensors")


# The 2-process runs (2 processes x 2 micro-steps of 2), by name: their overrides.
TWO_PROCESS_RUNS = {
    **{strategy: [f"data_parallel={strategy}"] for strategy in ("ddp", "zero1", "zero2", "zero3")},
    **{f"activation_checkpointing_{strategy}": [f"data_parallel={strategy}", "activation_checkpointing=true"]
       for strategy in ("ddp", "zero3")},
    "fused_chunks": ["loss_chunks=3", "data_parallel=zero3"],
}


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict[str, Path]:
    """Every run of TWO_PROCESS_RUNS, one after another in one launch; by name, their output folders."""
    root = tmp_path_factory.mktemp("two_processes")
    runs = {name: RecipeRun("full_finetune", root / name, *COMMON, *args) for name, args in TWO_PROCESS_RUNS.items()}
    result = run_recipes(list(runs.values()), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: r.output_dir for name, r in runs.items()}


def assert_same_training(out: Path, reference, *, weight_atol: float = 1e-6) -> None:
    ref_losses, ref_weights = reference
    torch.testing.assert_close(losses(out), ref_losses, rtol=1e-5, atol=0)
    weights = load_file(out / "final" / "model.safetensors")
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=weight_atol)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_two_processes_each_strategy(strategy, reference, two_process_runs):
    # 2 processes x 2 micro-steps of 2.
    out = two_process_runs[strategy]
    assert_same_training(out, reference)


def test_hsdp_on_a_2x2_mesh(reference, four_processes):
    # 4 processes x 1 micro-step: shard over pairs, replicate across the two pairs (COMMON, data_parallel=hsdp and
    # hsdp_shard_size=2, in the shared launch).
    assert_same_training(four_processes / "hsdp", reference)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_activation_checkpointing_changes_nothing(strategy, reference, two_process_runs):
    out = two_process_runs[f"activation_checkpointing_{strategy}"]  # 2 processes
    assert_same_training(out, reference)


@pytest.mark.parametrize("loss", ["logits", "fused_chunks"])
def test_the_loss_path_changes_nothing(loss, reference, request, tmp_path):
    # The reference takes the fused projection and loss in one chunk (the demo's default). Whole logits then the
    # loss (fused_loss=false), and the fused loss in 3 chunks on zero3 (FSDP2's gathered output weight gets the
    # gradient computed in forward): the same training. The logits' gradient is computed another way (softmax -
    # one_hot from one float32 softmax, against autograd's chain through log_softmax), so the weights get 1e-5
    # absolute rather than 1e-6: measured, one of the 0.9M weights moved 4e-6 (Adam's 1/sqrt(v) enlarges
    # rounding-level gradient differences on entries with near-zero gradients, as the module docstring says).
    if loss == "logits":  # 1 process
        out = tmp_path
        run(out, "fused_loss=false")
    else:  # 2 processes
        out = request.getfixturevalue("two_process_runs")["fused_chunks"]
    assert_same_training(out, reference, weight_atol=1e-5)


def test_logged_loss_is_the_global_token_mean_not_a_mean_of_micro_batch_means(reference):
    """Recompute step 1 by hand: the logged loss is the mean over the global batch's tokens, and a mean of
    per-micro-batch means (what the test data makes visibly different) is not what we log."""
    set_seed(0)
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=64)
    materialize(model, device=torch.device("cpu"))
    init_weights(model)
    tokenizer = byte_tokenizer(max_seq_len=64)
    dataset = demo_dataset(tokenizer, num_samples=256, seed=0, word_len=(2, 8))
    indices = list(GlobalBatchSampler(len(dataset), global_batch_size=8, seed=0))[:8]
    token_sums, token_counts = [], []
    with torch.no_grad():
        for micro in (indices[i : i + 2] for i in range(0, 8, 2)):
            batch = padded_collate([dataset[i] for i in micro], pad_id=tokenizer.pad_id)
            logits = model(batch["tokens"])
            token_sums.append(F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum").item())
            token_counts.append(int((batch["labels"] != -100).sum()))
    assert len(set(token_counts)) > 1, "micro-batches should hold different numbers of trained tokens"
    global_mean = sum(token_sums) / sum(token_counts)
    mean_of_means = sum(s / c for s, c in zip(token_sums, token_counts)) / len(token_counts)
    logged = reference[0][0]
    assert logged == pytest.approx(global_mean, rel=1e-5)
    assert abs(mean_of_means - global_mean) > 100 * abs(logged - global_mean) + 1e-4
