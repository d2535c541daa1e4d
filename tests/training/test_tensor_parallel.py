"""Promise 1 across tensor-parallel layouts: one process, tp=2, tp=4, ddp x tp=2, zero3 x tp=2 and hsdp x tp=2
train the same model from the same global batches and then generate the same tokens; so does the recipe, and its
step checkpoints resume on the same layout (bitwise) and on one process; the generate and eval recipes on one model
split over 2 processes give what they give on one.

One torchrun launch of 4 processes (tests/training/_tp_worker.py) runs every layout of a tiny Llama 3 (rope
scaling), Qwen 2.5 (q/k/v biases, tied embeddings) and Gemma 2 (soft-caps, sliding window, tied), full fine-tune,
LoRA (on Llama's output projection too) and DoRA; this process trains the one-process reference of each case
with the same code and compares. fp32 on CPU: the layouts differ only in the order of float sums (split matmuls,
reductions over ranks, micro-batches padded differently), so losses agree to about 1e-7 relative and the weights
after 5 AdamW steps to about 1e-6; we allow 1e-5 for both.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipe_here, run_recipes, run_tune_here, run_workers
from tests.training import _tp_worker as worker
from toolkit.parallel import ParallelDims


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp")
    result = run_workers(worker.__file__, str(out / "results.pt"), str(out / "recipe"), nproc=4, timeout_s=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def layouts(launch) -> dict:
    return torch.load(launch / "results.pt", weights_only=True)


@pytest.fixture(scope="module")
def references() -> dict:
    # One thread, as each worker has: these tiny matmuls run 30x slower on a pool of threads that another process
    # keeps busy.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_process = ParallelDims("ddp", dp_replicate=1, dp_shard=1)
        return {case: worker.train(*case, one_process) for case in sorted({(n, m) for n, m, _ in worker.RUNS})}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("run", worker.RUNS, ids=lambda run: "/".join(run))
def test_every_layout_trains_like_one_process(run, layouts, references):
    name, mode, layout = run
    ours, reference = layouts[f"{name}/{mode}/{layout}"], references[(name, mode)]
    torch.testing.assert_close(ours["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["norms"], reference["norms"], rtol=1e-5, atol=0)
    assert ours["weights"].keys() == reference["weights"].keys()
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], weight, rtol=1e-5, atol=1e-5, msg=key)
    # The run trained: weights that did not move would agree with anything.
    assert reference["moved"] > 1e-3


@pytest.mark.parametrize("run", worker.RUNS, ids=lambda run: "/".join(run))
def test_every_layout_generates_what_one_process_does(run, layouts, references):
    # The trained model of each layout, its KV cache holding each rank's heads: the same tokens, greedy and sampled
    # (the gathered logits are the same on every rank, so every rank draws the same token), and the prompt's logits
    # to float rounding.
    name, mode, layout = run
    ours, reference = layouts[f"{name}/{mode}/{layout}"], references[(name, mode)]
    assert ours["greedy"] == reference["greedy"]
    assert ours["sampled"] == reference["sampled"]
    assert len(set(reference["sampled"])) > 1  # draws that always gave one token would agree with anything
    torch.testing.assert_close(ours["logits"], reference["logits"], rtol=1e-5, atol=1e-5)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "model.safetensors")


def test_the_recipe_on_zero3_over_tensor_parallel_pairs_trains_like_one_process(launch, tmp_path):
    # The demo recipe in this process against the worker's 4 processes (2 ZeRO-3 ranks of TP pairs): the same
    # losses, tokens, gradient norms and exported weights. The split matmuls sum in another order: after 5 AdamW
    # steps a weight may differ by 1e-5 (measured: one of the 0.9M by 2e-6; Adam's 1/sqrt(v) enlarges rounding-level
    # gradient differences on entries with near-zero gradients, see test_parallel_parity.py).
    run_recipe_here("full_finetune", "demo", *worker.RECIPE, f"output_dir={tmp_path}")
    ours, reference = _records(launch / "recipe"), _records(tmp_path)
    torch.testing.assert_close([r["loss"] for r in ours], [r["loss"] for r in reference], rtol=1e-5, atol=0)
    # Each token counted once, not once per rank of its pair, and each gradient at its size (AdamW alone would hide a
    # gradient scaled by 2; the clipped norm does not).
    assert [r["num_tokens"] for r in ours] == [r["num_tokens"] for r in reference]
    torch.testing.assert_close([r["grad_norm"] for r in ours], [r["grad_norm"] for r in reference], rtol=1e-5, atol=0)
    weights, expected = _weights(launch / "recipe"), _weights(tmp_path)
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(weights[key], weight, rtol=1e-4, atol=1e-5, msg=key)


def test_a_resume_on_the_same_layout_is_bitwise_exact(launch):
    uninterrupted, resumed = launch / "recipe", launch / "recipe_resumed"
    assert [r["step"] for r in _records(resumed)] == list(range(worker.RESUMED_AT + 1, 6))
    assert [r["loss"] for r in _records(resumed)] == [r["loss"] for r in _records(uninterrupted)][worker.RESUMED_AT :]
    weights, expected = _weights(resumed), _weights(uninterrupted)
    assert weights.keys() == expected.keys()
    for key, weight in expected.items():
        assert torch.equal(weights[key], weight), key


def test_a_tensor_parallel_checkpoint_resumes_on_one_process(launch, tmp_path):
    # DCP reshards the TP (and ZeRO-3) shards of the model and optimizer state to whole tensors; the sample order and
    # the RNG state carry over. Another layout sums in another order: float rounding.
    checkpoint = launch / "recipe" / "checkpoints" / f"step_{worker.RESUMED_AT}"
    run_recipe_here("full_finetune", "demo", *worker.RECIPE, f"output_dir={tmp_path}", f"resume_from={checkpoint}")
    expected = [r["loss"] for r in _records(launch / "recipe")][worker.RESUMED_AT :]
    torch.testing.assert_close([r["loss"] for r in _records(tmp_path)], expected, rtol=1e-5, atol=0)


# Few enough samples to keep the evaluation short; generation stops at the byte tokenizer's end of sequence.
EVAL = ["dataset.num_samples=32", "eval_tasks.num_samples=12", "micro_batch_size=8"]
# The random model of the seed (checkpoint_dir=null: each process draws the whole tensors and keeps its part): the
# 5-step model's reply is its end-of-sequence token at once, even sampled, which would agree with anything. The eval
# run below loads the trained checkpoint.
PROMPT = ["prompt=reverse: tensor", "checkpoint_dir=null"]


@pytest.fixture(scope="module")
def split_over_two(launch) -> dict[str, RecipeRun]:
    """The generate and eval recipes, tensor_parallel=2 on 2 processes, in one launch."""
    checkpoint = launch / "recipe" / "final"
    runs = {
        "generate": RecipeRun("generate", launch / "generate_tp2", "tensor_parallel=2", *PROMPT),
        "eval": RecipeRun("eval", launch / "eval_tp2", "tensor_parallel=2", f"checkpointer.checkpoint_dir={checkpoint}",
                          *EVAL),
    }
    result = run_recipes(list(runs.values()), nproc=2, timeout_s=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return runs


def test_the_generate_recipe_split_over_two_processes_replies_as_one_does(split_over_two):
    one = run_tune_here("run", "generate", "--config", "demo", *PROMPT)
    assert one.returncode == 0, one.stderr
    assert split_over_two["generate"].stdout() == one.stdout
    assert one.stdout.strip()  # a reply, not nothing twice


def test_the_eval_recipe_split_over_two_processes_scores_as_one_does(launch, split_over_two, tmp_path):
    run_recipe_here("eval", "demo", f"checkpointer.checkpoint_dir={launch / 'recipe' / 'final'}", *EVAL,
                    f"output_dir={tmp_path}")
    one = json.loads((tmp_path / "eval.json").read_text())
    two = json.loads((split_over_two["eval"].output_dir / "eval.json").read_text())
    # Each token counted once (not once per rank of the pair); the split matmuls sum in another order.
    assert two["val_tokens"] == one["val_tokens"]
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
    assert (two["correct"], two["total"]) == (one["correct"], one["total"])
