"""Context parallelism's attention (toolkit.parallel.context_parallel) against the same layer over whole rows.

One torchrun launch of 4 processes (``_cp_worker.py``) runs every case on one CP group of 4 and on two groups of
2, for both methods (the ring with its fused block kernel where one applies, and with its explicit one everywhere):
grouped-query, multi-head and one key/value head (which ``alltoall`` repeats to share out), packed documents crossing
the chunk boundaries, a sliding window, and all of these with Gemma 2's soft-cap. In
float64 the split computes the same sums in another order: outputs, input gradients and weight gradients agree
to about 1e-14 (measured at most 1.1e-14); we allow 1e-12. The soft-capped reference takes its softmax in float32
(as Gemma 2's code does; the ring keeps float64), so there the two agree to float32's rounding (measured 1e-6).
"""

import json

import pytest
import torch

from tests.launch import removing, run_workers
from toolkit.parallel.context_parallel import CP_METHODS, context_parallel_problems, local_positions
from tests.modules import _cp_worker as worker


@pytest.fixture(scope="module")
def errors(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp") / "errors.json"
    result = run_workers(worker.__file__, str(out), nproc=4, timeout_s=300, clean_for_retry=removing(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("split", worker.SPLITS)
@pytest.mark.parametrize("case", worker.CASES)
def test_split_attention_equals_whole_row_attention(errors, case, split, cp):
    found = errors[f"{case}/cp{cp}/{split}"]
    softcapped = worker.CASES[case][4] is not None
    assert found["error"] <= (1e-5 if softcapped else 1e-12) * found["scale"]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_split_covers_each_position_once_with_equal_causal_work(cp):
    seq = 24 * cp
    parts = [local_positions(seq, cp=cp, rank=r) for r in range(cp)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(seq))
    # Causal (query, key) pairs per rank: a query at position p scores p + 1 keys.
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def test_a_length_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="divisible by 4"):
        local_positions(10, cp=2, rank=0)


def test_alltoall_needs_the_heads_per_tensor_parallel_rank_divisible():
    assert context_parallel_problems(context_parallel=2, method="alltoall", num_heads=4) == []
    (key, problem), = context_parallel_problems(context_parallel=4, method="alltoall", num_heads=8, tensor_parallel=4)
    assert key == "context_parallel" and "2 attention heads per tensor-parallel rank" in problem
    assert context_parallel_problems(context_parallel=3, method="ring", num_heads=4) == []
    (key, _), = context_parallel_problems(context_parallel=2, method="zigzag")
    assert key == "context_parallel_method"


@pytest.mark.parametrize("method", CP_METHODS)
def test_the_padding_of_unpacked_rows_keeps_within_the_real_positions(method):
    # context_parallel: 3 pads a 64-token row (max_seq_len 64) to 66 positions; rank 0 holds the last chunk, whose
    # row positions 64 and 65 lie past a rotary table of 64 (an IndexError mid-run before). The padding's
    # positions are held at the last real one: nothing attends to it and it has no target.
    from toolkit.parallel.context_parallel import ContextParallel

    seq_len, cp = 66, 3
    batch = {"tokens": torch.zeros(2, seq_len, dtype=torch.long), "labels": torch.zeros(2, seq_len, dtype=torch.long),
             "lengths": torch.tensor([64, 50])}
    for rank in range(cp):
        split = ContextParallel(group=None, size=cp, rank=rank, method=method)
        local, _ = split.shard(batch, full_mask=lambda b: None)
        row = local_positions(seq_len, cp=cp, rank=rank)
        assert local["input_pos"].max() <= 63
        real = row < 64
        assert torch.equal(local["input_pos"][real], row[real])  # every real token keeps its position
        assert torch.equal(local["tokens"], batch["tokens"][:, row])
