"""The ring's block kernels (toolkit.parallel.context_parallel) on one process: a row split over ``cp`` ranks, every
rank's queries attending to every rank's key/value blocks in ring order, forward and backward, with the ring's own
block functions but no process group (the exchanges are the only part left out; ``test_context_parallel.py`` runs
them across processes).

The fused kernel (on CPU PyTorch's flash kernel; on CUDA flash and memory-efficient) and the explicit matmul kernel
are each checked against SDPA over the whole row, outputs and the gradients of queries, keys and values: grouped-query
and multi-head, packed documents crossing the chunk boundaries (whose blocks hold rows that see no key of theirs), a
sliding window, with whole chunk pairs scored at once and cut into pieces of a few rows (``RING_SCORE_BLOCK``
lowered). float64 agrees to about 1e-15 (we allow 1e-12 of the largest value); float32 to about 1e-7 (we allow 1e-5),
the same rounding as one process's kernel; bfloat16 (8 bits: rounding 4e-3) to at most 6e-3 (we allow 2e-2).
"""

import pytest
import torch
import torch.nn.functional as F

from toolkit.parallel import context_parallel as cpmod
from toolkit.parallel.context_parallel import ContextParallel, fused_ring_kernel, local_positions

SEQ, BATCH = 48, 2
# name: (heads, kv heads, packed documents, sliding window)
CASES = {
    "gqa": (4, 2, False, None),
    "mha": (4, 4, False, None),
    "packed": (4, 2, True, None),
    "window": (4, 1, False, 7),
    "packed_window": (4, 2, True, 5),
}


def document_ids(packed: bool, device) -> torch.Tensor | None:
    # Documents of uneven lengths that cross the chunk boundaries (chunks of 6 and 12 positions).
    if not packed:
        return None
    ids = [torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]) for lengths in ([5, 14, 1, 20, 8],
                                                                                            [30, 11, 7])]
    return torch.stack(ids).to(device)


def whole_row(q, k, v, *, docs, window):
    """SDPA over the whole row: q [b, h, S, d], k and v [b, kv, S, d]."""
    pos = torch.arange(q.shape[2], device=q.device)
    allowed = pos[:, None] >= pos[None, :]
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    if docs is not None:
        allowed = allowed & (docs[:, :, None] == docs[:, None, :])[:, None]
    groups = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                          attn_mask=allowed, scale=0.3)


def ring_on_one_process(q, k, v, dout, *, cp: int, docs, window, fused: bool):
    """The ring's forward and backward for every rank of ``cp`` in turn; the results in row order."""
    b, h, seq, d = q.shape
    kv, acc = k.shape[1], torch.promote_types(q.dtype, torch.float32)
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    held = [local_positions(seq, cp=cp, rank=r, device=q.device) for r in range(cp)]
    for rank in range(cp):
        spec = cpmod._RingSpec(cp=ContextParallel(None, cp, rank), seq_len=seq, document_ids=docs, scale=0.3,
                               window=window, softcap=None, fused=fused)
        inputs = (q, k, v) if fused else (q.to(acc), k.to(acc), v.to(acc))
        q_r = inputs[0][:, :, held[rank]].reshape(b, kv, h // kv, -1, d)
        out_r = torch.zeros(q_r.shape, dtype=acc, device=q.device)
        lse = torch.full(q_r.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        for source in range(cp):  # the ring's order does not change the sums' result beyond rounding
            cpmod._attend_source(spec, q_r, inputs[1][:, :, held[source]], inputs[2][:, :, held[source]], source,
                                 out_r, lse)
        result = out_r.to(q.dtype)
        dout_r = dout[:, :, held[rank]].reshape(q_r.shape).to(q_r.dtype)
        saved, delta = (result, None) if fused else (out_r, (dout_r * out_r).sum(-1))
        dq_r = torch.zeros(q_r.shape, dtype=acc, device=q.device)
        for source in range(cp):
            dk_s, dv_s = dk[:, :, held[source]], dv[:, :, held[source]]
            cpmod._add_source_grads(spec, q_r, dout_r, saved, lse, delta, inputs[1][:, :, held[source]],
                                    inputs[2][:, :, held[source]], source, dq_r, dk_s, dv_s)
            dk[:, :, held[source]], dv[:, :, held[source]] = dk_s, dv_s
        out[:, :, held[rank]] = result.reshape(b, h, -1, d)
        dq[:, :, held[rank]] = dq_r.reshape(b, h, -1, d).to(q.dtype)
    return out, dq, dk.to(k.dtype), dv.to(v.dtype)


def largest_error(case: str, cp: int, fused: bool, *, dtype, device, head_dim: int = 8) -> float:
    """The largest difference of the ring's output and gradients from whole-row SDPA's in float64 on the same
    inputs, over the largest value among them."""
    heads, kv, packed, window = CASES[case]
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(BATCH, heads, SEQ, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(BATCH, kv, SEQ, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    docs = document_ids(packed, device)
    found = ring_on_one_process(q, k, v, dout, cp=cp, docs=docs, window=window, fused=fused)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out = whole_row(*leaves, docs=docs, window=window)
    expected = (ref_out.detach(), *torch.autograd.grad(ref_out, leaves, dout.double()))
    for value in found:
        assert torch.isfinite(value).all()
    scale = max(float(t.abs().max()) for t in expected)
    return max(float((got.double() - want).abs().max()) for got, want in zip(found, expected)) / scale


@pytest.mark.parametrize("score_block", [cpmod.RING_SCORE_BLOCK, 64])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16],
                         ids=["float64", "float32", "bfloat16"])
def test_ring_kernels_equal_whole_row_attention_on_cpu(monkeypatch, dtype, case, cp, fused, score_block):
    monkeypatch.setattr(cpmod, "RING_SCORE_BLOCK", score_block)  # 64: masked pairs cut into blocks of 1-2 rows
    error = largest_error(case, cp, fused, dtype=dtype, device="cpu")
    assert error <= {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]


def test_the_fused_kernel_is_taken_where_pytorch_has_one():
    assert fused_ring_kernel(torch.zeros(1, 2, 4, 8, dtype=torch.float32))
    assert fused_ring_kernel(torch.zeros(1, 2, 4, 8, dtype=torch.float64))
    assert fused_ring_kernel(torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16))
    assert not fused_ring_kernel(torch.zeros(1, 2, 4, 8, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_ring_kernels_equal_whole_row_attention_on_cuda(dtype, case, fused):
    # bfloat16: flash for unmasked and causal blocks, memory-efficient for masked ones; float32: memory-efficient.
    # Against float64 on the same rounded inputs: bfloat16 outputs and gradients hold 8 bits (rounding 4e-3).
    assert fused_ring_kernel(torch.zeros(1, 1, 1, 16, dtype=dtype, device="cuda"))
    error = largest_error(case, 4, fused, dtype=dtype, device="cuda", head_dim=16)
    assert error <= (2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.parametrize("case", ["gqa", "packed", "window"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_the_cuda_kernels_are_called_as_their_schemas_say(dtype, case):
    # Meta tensors run the CUDA branch's calls (flash, memory-efficient, their backwards) through the operators'
    # shape functions without a GPU: arguments, the log-sum-exp's layout and the gradients' shapes.
    heads, kv, packed, window = CASES[case]
    q, dout = (torch.empty(BATCH, heads, SEQ, 16, device="meta", dtype=dtype) for _ in range(2))
    k, v = (torch.empty(BATCH, kv, SEQ, 16, device="meta", dtype=dtype) for _ in range(2))
    docs = document_ids(packed, "cpu")
    found = ring_on_one_process(q, k, v, dout, cp=4, docs=None if docs is None else docs.to("meta"), window=window,
                                fused=True)
    assert [t.shape for t in found] == [q.shape, q.shape, k.shape, v.shape]
