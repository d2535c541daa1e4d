"""Promise 1 across context-parallel layouts: sequences split over 2 or 4 ranks train as on one process.

One torchrun launch of 4 processes (``_cp_worker.py``, whose docstring lists the layouts and runs) trains tiny
Llama 3 (grouped-query attention, rope scaling) and Gemma 2 (sliding window, soft-caps) models, full and LoRA, on
unpacked and packed rows, with every row split over a CP group (alone, with DDP, ZeRO-3 and tensor parallelism 2)
for both methods; this process trains each one-process reference with the same code. fp32 on CPU: the layouts
differ only in the order of float sums (attention's softmax combined from blocks, gradients summed over ranks), so
losses agree to about 1e-7 relative and the weights after 5 AdamW steps to a few 1e-6; we allow 1e-5 for both, as
for tensor parallelism.

The same launch runs the full fine-tune recipe on the demo with ``context_parallel=2`` and resumes its step-2
checkpoint with ``context_parallel=4`` (and the other method): both follow the one-process run of the same config.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import as_in_a_subprocess, removing, run_workers
from tests.training import _cp_worker as worker
from toolkit.parallel import ParallelDims, parallel_dims
from toolkit.parallel.context_parallel import CP_METHODS
from toolkit.errors import UserError


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp_layouts")
    # Each rank's output kept apart: a rank that dies (SIGABRT from a corrupted heap in C++, once in a few runs of
    # the whole suite) says why at the end of stderr, after the others' "connection closed"; such a launch is
    # launched again (run_workers).
    result = run_workers(worker.__file__, str(out), nproc=4, timeout_s=600, per_rank_logs=True,
                         clean_for_retry=removing(out))
    assert result.returncode == 0, result.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def layouts(launched) -> dict:
    return torch.load(launched / "results.pt", weights_only=True)


@pytest.fixture(scope="module")
def references() -> dict:
    with as_in_a_subprocess():
        one_process = ParallelDims("ddp", dp_replicate=1, dp_shard=1)
        cases = sorted({(name, mode, data) for name, mode, data, _ in worker.RUNS})
        return {case: worker.train(*case, one_process) for case in cases}


@pytest.mark.parametrize("method", CP_METHODS)
@pytest.mark.parametrize("run", worker.RUNS, ids="/".join)
def test_every_context_parallel_layout_trains_like_one_process(run, method, layouts, references):
    name, mode, data, layout = run
    ours, reference = layouts[f"{name}/{mode}/{data}/{layout}/{method}"], references[(name, mode, data)]
    torch.testing.assert_close(ours["losses"], reference["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["norms"], reference["norms"], rtol=1e-5, atol=0)
    assert ours["weights"].keys() == reference["weights"].keys()
    for key, weight in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][key], weight, rtol=1e-5, atol=1e-5, msg=key)
    assert reference["moved"] > 1e-3  # the run trained: weights that did not move would agree with anything
    # ... and the rows were split: each rank's layers saw 1/cp of every micro-batch's positions.
    # (With activation checkpointing each layer's forward runs again in backward: each micro-batch twice.)
    cp, again = worker.LAYOUTS[layout][2], 2 if layout.endswith("_ac") else 1
    assert ours["positions"]["seen"] == [n // cp for n in ours["positions"]["rows"] for _ in range(again)]


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out) -> list[float]:
    return [r["loss"] for r in _records(out) if "loss" in r]


def test_the_held_out_loss_is_the_same_split_or_whole(launched):
    # The same weights (after step 5) scored with each row split over 2 (ring) and 4 (alltoall) ranks, and whole.
    scores = {name: next(r for r in _records(launched / name) if "val_loss" in r)
              for name in ("recipe", "recipe_resumed", "recipe_cp1")}
    whole = scores["recipe_cp1"]
    for name in ("recipe", "recipe_resumed"):
        assert scores[name]["val_tokens"] == whole["val_tokens"]
        assert scores[name]["val_loss"] == pytest.approx(whole["val_loss"], rel=1e-5)


def test_the_recipe_with_context_parallelism_trains_like_one_process(launched, one_process):
    torch.testing.assert_close(_losses(launched / "recipe"), _losses(one_process), rtol=1e-5, atol=0)
    ours, reference = (load_file(out / "final" / "model.safetensors") for out in (launched / "recipe", one_process))
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.parametrize("run", ["recipe_zero1", *(f"recipe_compiled_{method}" for method in CP_METHODS)])
def test_zero1_and_compile_over_context_parallel_pairs_train_like_one_process(run, launched, one_process):
    # compile: inductor's fused kernels sum in other orders than eager's, within the same float32 rounding.
    torch.testing.assert_close(_losses(launched / run), _losses(one_process), rtol=1e-5, atol=0)
    ours, reference = (load_file(out / "final" / "model.safetensors") for out in (launched / run, one_process))
    for key in reference:
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_run_resumed_on_another_context_parallel_degree_continues_it(launched, one_process):
    resumed = _losses(launched / "recipe_resumed")
    assert len(resumed) == 3  # steps 3 to 5
    torch.testing.assert_close(resumed, _losses(launched / "recipe")[2:], rtol=1e-5, atol=0)
    torch.testing.assert_close(resumed, _losses(one_process)[2:], rtol=1e-5, atol=0)


def test_the_layout_counts_samples_over_the_context_parallel_groups():
    dims = parallel_dims(strategy="zero3", world_size=8, local_world_size=8, device_type="cpu", tensor_parallel=2,
                         rank=5, context_parallel=2)
    # Ranks 4, 5 are tensor-parallel pair 2 (data-parallel rank 2), the first of CP pair 1 (data-parallel ranks 2, 3).
    assert (dims.dp_size, dims.dp_rank, dims.batch_ranks, dims.batch_rank) == (4, 2, 2, 1)
    assert dims.label == "zero3 x context_parallel 2 x tensor_parallel 2"
    with pytest.raises(UserError, match="context_parallel: 3 does not divide the 4 data-parallel processes"):
        parallel_dims(strategy="zero3", world_size=8, local_world_size=8, device_type="cpu", tensor_parallel=2,
                      context_parallel=3)
