"""Context parallelism: each sequence split over ``cp`` ranks along its positions, attention computed across them.

**The split.** A row of ``S`` positions is cut into ``2 x cp`` equal chunks and rank ``r`` holds chunks ``r`` and
``2 cp - 1 - r``: one early and one late, so that under the causal mask every rank has the same number of
(query, key) pairs to score (the late chunk sees many keys, the early one few). Tokens, labels and positions are
cut alike (:meth:`ContextParallel.shard`), so rotary positions follow the tokens and each rank's loss scores only
its own positions; the token count of the loss normalization, summed over the data-parallel ranks (CP ranks
among them), counts every position once. ``S`` must be a multiple of ``2 x cp``: the collate pads to one.

**The attention**, by ``method``:

- ``alltoall`` (Ulysses; Jacobs et al., 2023, https://arxiv.org/abs/2309.14509): one all-to-all trades each
  rank's share of the sequence for a share of the heads, so every rank holds the whole sequence for
  ``heads / cp`` heads and attends with the layer's own kernel (SDPA's causal one, or FlexAttention or a dense
  mask for packed documents, Gemma 2's soft-capped scores), then a second all-to-all trades back. Needs the heads
  divisible by ``cp``; key/value heads that are not are repeated up to the query heads first.
- ``ring`` (Liu et al., 2023, https://arxiv.org/abs/2310.01889): the key/value blocks travel round the ranks,
  each rank scoring its queries against one block per step while the next block is in flight, and the partial
  softmaxes are combined exactly through their log-sum-exp. The backward recomputes the scores block by block
  and sends the key/value gradients round the ring after their blocks. Fully masked chunk pairs are skipped. Each
  block is scored by PyTorch's fused attention kernel that returns the log-sum-exp where one takes it
  (:func:`fused_ring_kernel`: the CPU flash kernel; on CUDA flash, or memory-efficient for masked blocks and
  float32): its backward, given the whole row's output and log-sum-exp, yields the block's exact share of the
  gradients. Packed documents and sliding windows reach it as an additive mask, a chunk against itself as its causal
  flag. Where none applies (Gemma 2's soft-caps, float64 on CUDA) the ring's explicit kernel scores in float32
  (float64 for float64 inputs) for one chunk of queries at a time, so its memory stays bounded at any length.

Both are exact: the outputs and gradients equal single-process attention over the whole row up to float
rounding (``tests/modules/test_context_parallel.py`` checks float64 against SDPA, ``test_ring_kernels.py`` each ring
kernel in float64 and float32).

**Where CP ranks sit.** They are data-parallel ranks that read the same samples: FSDP2 or DDP reduce their
gradients like any other data-parallel rank's (each holds the gradient of its positions' share of the loss), so
the data-parallel mesh and strategies are unchanged and ``dp_size`` still counts them. The sampler and the batch
arithmetic count ``dp_size / cp`` ranks (:attr:`~toolkit.parallel.ParallelDims.batch_ranks`). The ring and the
all-to-all run over the ``cp`` dimension of the mesh ``(batch, cp, tp)`` over the same ranks
(:meth:`~toolkit.parallel.ParallelDims.context_parallel`): ``cp`` consecutive data-parallel ranks, tensor
parallelism inside each. That is docs/design.md's rank order ``dp_replicate x dp_shard x cp x tp``, held as two meshes
rather than one with ``cp`` as its own dimension: FSDP2 would otherwise shard over ``dp_shard`` and ``cp`` flattened
(as torchtitan does), and every strategy, its gradient reduction and the token counts would need the flattened
dimension; as data-parallel ranks, the CP ranks need none of that. Nor is the model transformed (no ``apply_cp``):
the split is in the batch and in the attention the decoder is given as its ``mask``
(:class:`~toolkit.modules.attention.SplitSequenceAttention`), so the same model trains split or whole.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from toolkit.modules.masks import document_ids
from toolkit.modules.attention import DocumentMasks, GroupedQueryAttention, SplitSequenceAttention

CP_METHODS = ("ring", "alltoall")
# Scores of the ring's explicit kernel are computed for this many (query, key, row, head) tuples at a time, at most
# (float32: 8 MiB per buffer, a few buffers at once), so its memory does not grow with the square of the sequence.
RING_SCORE_BLOCK = 1 << 21


def local_positions(seq_len: int, *, cp: int, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The row positions rank ``rank`` of ``cp`` holds: chunks ``rank`` and ``2 cp - 1 - rank`` of ``2 cp``.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 x cp``.
    """
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism over {cp} ranks needs a sequence length divisible by {2 * cp}, "
                         f"got {seq_len}")
    chunk = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([
        torch.arange(rank * chunk, (rank + 1) * chunk, device=device),
        torch.arange(late * chunk, (late + 1) * chunk, device=device),
    ])


def context_parallel_problems(
    *, context_parallel: int, method: str | None, num_heads: int | None = None, tensor_parallel: int = 1,
) -> list[tuple[str, str]]:
    """``(key, problem)`` for a method that does not fit the model's heads (``alltoall`` splits each rank's
    heads, ``num_heads / tensor_parallel``, over the CP ranks)."""
    if context_parallel == 1:
        return []
    if method not in CP_METHODS:
        return [("context_parallel_method", f"expected one of {', '.join(CP_METHODS)}, got {method!r}")]
    if method == "alltoall" and num_heads is not None and (num_heads // max(tensor_parallel, 1)) % context_parallel:
        local = num_heads // max(tensor_parallel, 1)
        where = f"{num_heads} attention heads" if tensor_parallel == 1 else (
            f"{local} attention heads per tensor-parallel rank ({num_heads} / tensor_parallel {tensor_parallel})")
        return [("context_parallel", f"{context_parallel} does not divide the model's {where}, which "
                 f"context_parallel_method=alltoall splits; use a divisor of {local}, or "
                 "context_parallel_method=ring")]
    return []


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its context-parallel group and how the group attends.

    Attributes:
        group: the ``cp`` ranks that share each sequence, in order (the mesh's ``cp`` dimension).
        size: ``cp``.
        rank: this rank's index in ``group``.
        method: ``ring`` or ``alltoall``.
        fused: ``ring`` scores its blocks with PyTorch's fused attention kernel where one takes them
            (:func:`fused_ring_kernel`); False: with its explicit kernel everywhere (tests and the benchmark compare
            the two).
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    method: str = "ring"
    fused: bool = True

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``rows`` ``[b, s, ...]``."""
        return rows[:, local_positions(rows.shape[1], cp=self.size, rank=self.rank, device=rows.device)]

    def shard(self, batch: dict[str, torch.Tensor], *, full_mask: Callable[[dict], object] | None = None):
        """This rank's part of a micro-batch (on its device), and the ``mask`` to give the decoder with it.

        ``tokens``, ``labels`` and ``input_pos`` (positions restarting at every packed document; the row positions
        where the batch has none) keep only :func:`local_positions`. ``full_mask(batch)`` builds the whole row's
        attention mask, which ``alltoall`` attends with (the trainer's
        :func:`~toolkit.training.attention_backend.batch_attention_mask`).
        """
        tokens = batch["tokens"]
        seq_len = tokens.shape[-1]
        positions = local_positions(seq_len, cp=self.size, rank=self.rank, device=tokens.device)
        input_pos = batch.get("input_pos")
        local = {key: value for key, value in batch.items() if key not in ("mask", "lengths")}
        for key in ("tokens", "labels"):
            if key in batch:
                local[key] = batch[key][:, positions]  # (labels are already shifted: each stays with its token)
        if input_pos is None:
            # Unpacked rows: the row positions, those of the padding up to a multiple of 2 x cp held at the last
            # real one. That padding can reach past max_seq_len, and so past the model's rotary table; no real
            # token attends to it (it comes after them all) and it has no target, so its position changes nothing.
            lengths = batch.get("lengths")
            last = None if lengths is None else (lengths.max() - 1).clamp(min=0).to(positions.device)
            local["input_pos"] = positions if last is None else torch.minimum(positions, last)  # (no host sync)
        else:
            local["input_pos"] = input_pos[:, positions]
        if self.method == "alltoall":
            whole = full_mask(batch) if full_mask is not None else None
            return local, UlyssesAttention(self, seq_len=seq_len, whole_mask=whole, device=tokens.device)
        docs = None if input_pos is None else document_ids(input_pos)
        return local, RingAttention(self, seq_len=seq_len, document_ids=docs, fused=self.fused)


class UlyssesAttention(SplitSequenceAttention):
    """``alltoall``: trade sequence for heads, attend over the whole row, trade back (see the module's notes)."""

    def __init__(self, cp: ContextParallel, *, seq_len: int, whole_mask, device: torch.device) -> None:
        self.cp = cp
        self.whole_mask = whole_mask
        # The row positions in the order the all-to-all gathers them (rank 0's, then rank 1's, ...), and back; made
        # once per micro-batch on the activations' device, for every layer.
        self._order = torch.cat([local_positions(seq_len, cp=cp.size, rank=r, device=device) for r in range(cp.size)])
        self._natural = torch.argsort(self._order)

    def attend(self, layer: GroupedQueryAttention, q, k, v):
        n = self.cp.size
        if q.shape[1] % n:
            raise ValueError(f"alltoall context parallelism over {n} ranks needs the heads ({q.shape[1]} here) "
                             f"divisible by {n}")
        if k.shape[1] % n:  # too few key/value heads to share out: each query head gets its own copy
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        q, k, v = (self._to_heads(t)[:, :, self._natural] for t in (q, k, v))  # [b, h / n, S, d], row order
        mask = self.whole_mask
        if isinstance(mask, DocumentMasks):
            mask = mask.for_layer(layer)
        out = layer.attend(q, k, v, mask=mask)  # [b, h / n, S, d]
        return self._to_sequence(out[:, :, self._order])

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        # [b, h, s, d] (this rank's positions, every head) -> [b, h / n, n s, d] (every rank's positions, in rank
        # order, for this rank's heads): head group j goes to rank j.
        n, (b, h, s, d) = self.cp.size, x.shape
        send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # [n, b, h / n, s, d]
        got = all_to_all_single_autograd(send.flatten(), None, None, self.cp.group)
        return got.view(n, b, h // n, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        # The inverse of _to_heads: [b, h / n, n s, d] -> [b, h, s, d].
        n, (b, hn, ns, d) = self.cp.size, x.shape
        send = x.reshape(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4).contiguous()  # [n, b, h / n, s, d]
        got = all_to_all_single_autograd(send.flatten(), None, None, self.cp.group)
        return got.view(n, b, hn, ns // n, d).transpose(0, 1).reshape(b, n * hn, ns // n, d)


class RingAttention(SplitSequenceAttention):
    """``ring``: key/value blocks passed round the CP ranks, partial softmaxes combined by log-sum-exp.

    Args:
        cp: this rank's place in its context-parallel group.
        seq_len: the whole row's length.
        document_ids: ``[b, seq_len]``, the packed documents each position belongs to (None: unpacked rows).
        fused: score the blocks with PyTorch's fused attention kernel where one takes them (:func:`fused_ring_kernel`);
            False: with the explicit kernel everywhere.
    """

    def __init__(self, cp: ContextParallel, *, seq_len: int, document_ids: torch.Tensor | None,
                 fused: bool = True) -> None:
        self.cp = cp
        self.seq_len = seq_len
        self.document_ids = document_ids
        self.fused = fused

    def attend(self, layer: GroupedQueryAttention, q, k, v):
        b, h, s, d = q.shape
        groups = h // k.shape[1]
        scale = layer.softmax_scale if layer.softmax_scale is not None else layer.head_dim**-0.5
        spec = _RingSpec(
            cp=self.cp, seq_len=self.seq_len, document_ids=self.document_ids, scale=scale,
            window=layer.sliding_window, softcap=layer.logit_softcap,
            fused=self.fused and layer.logit_softcap is None and fused_ring_kernel(q),
        )
        q5 = q.reshape(b, k.shape[1], groups, s, d)  # [b, kv heads, groups, s, d]: GQA without copying k and v
        # Its float32 sums are its own: autocast (mixed precision) would run them in bfloat16.
        with torch.autocast(q.device.type, enabled=False):
            out = _RingFunction.apply(q5, k, v, spec)
        return out.reshape(b, h, s, d)


def fused_ring_kernel(q: torch.Tensor) -> bool:
    """Whether PyTorch has a fused attention kernel that returns the log-sum-exp for the ring's blocks of queries
    like ``q`` ``[b, h, s, d]``: on CPU its flash kernel (float64, float32, bfloat16); on CUDA the flash kernel
    (float16, bfloat16, blocks without a mask or with the causal one) and the memory-efficient kernel (float32 too,
    and masked blocks), for head dimensions that are multiples of 8 up to 256. None takes Gemma 2's soft-capped
    scores: those the ring scores with its explicit kernel."""
    if q.device.type == "cpu":
        return q.dtype in (torch.float64, torch.float32, torch.bfloat16)
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256)


@dataclass(frozen=True)
class _RingSpec:
    cp: ContextParallel
    seq_len: int
    document_ids: torch.Tensor | None
    scale: float
    window: int | None
    softcap: float | None
    fused: bool = False

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp.size)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices rank ``rank`` holds."""
        return rank, 2 * self.cp.size - 1 - rank

    def pairs(self, kv_rank: int):
        """``(local query slice, local key slice, first query row, first key row, whole)`` for every chunk pair of
        this rank's queries and ``kv_rank``'s keys with a key its query may see; ``whole``: every key is visible to
        every query (an earlier chunk, no sliding window), so the pair needs no mask unless documents restrict it."""
        c = self.chunk
        for qi, q_chunk in enumerate(self.chunks_of(self.cp.rank)):
            for ki, k_chunk in enumerate(self.chunks_of(kv_rank)):
                if k_chunk > q_chunk:
                    continue  # every key is in the future of every query
                if self.window is not None and (q_chunk - k_chunk - 1) * c + 1 >= self.window:
                    continue  # every key is outside the sliding window (the nearest pair is this far apart)
                whole = k_chunk < q_chunk and self.window is None
                yield slice(qi * c, (qi + 1) * c), slice(ki * c, (ki + 1) * c), q_chunk * c, k_chunk * c, whole

    def blocks(self, kv_rank: int, *, batch: int, heads: int, device: torch.device):
        """``(local query rows, local key slice, mask, causal)`` for every block of this rank's queries against
        ``kv_rank``'s keys that has a key its query may see: the chunk pairs, each cut into pieces of at most
        :data:`RING_SCORE_BLOCK` scores per row and head (the explicit kernel's buffers) or mask entries per row (a
        fused kernel's). ``mask`` is None where every key is visible to every query. A fused kernel needs no buffer
        of scores and applies the causal mask itself: a pair that needs no mask, or only the causal one (a chunk
        against itself, ``causal``), comes to it whole."""
        for q_sl, k_sl, q0, k0, whole in self.pairs(kv_rank):
            if self.fused and self.document_ids is None and (whole or self.window is None):
                yield q_sl, k_sl, None, not whole
                continue
            k_len = k_sl.stop - k_sl.start
            k_rows = k0 + torch.arange(k_len, device=device)
            for rows in _query_blocks(q_sl, k_len, batch if self.fused else batch * heads):
                if whole and self.document_ids is None:
                    yield rows, k_sl, None, False
                    continue
                q_rows = q0 + torch.arange(rows.start - q_sl.start, rows.stop - q_sl.start, device=device)
                yield rows, k_sl, self.mask(q_rows, k_rows), False

    def mask(self, q_rows: torch.Tensor, k_rows: torch.Tensor) -> torch.Tensor:
        # [b or 1, 1, 1, sq, sk], True where allowed: causal, within the window, within a document.
        distance = q_rows[:, None] - k_rows[None, :]
        allowed = distance >= 0
        if self.window is not None:
            allowed = allowed & (distance < self.window)
        if self.document_ids is not None:
            docs = self.document_ids
            allowed = allowed & (docs[:, q_rows, None] == docs[:, None, k_rows])  # [b, sq, sk]
        return allowed.reshape(-1, 1, 1, *allowed.shape[-2:])


def _score(spec: _RingSpec, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None):
    # q [b, kv, g, sq, d], k [b, kv, sk, d], float32 -> (masked scores, tanh of the soft-cap or None)
    scores = torch.einsum("bhgsd,bhtd->bhgst", q, k).mul_(spec.scale)  # (in place: one buffer of scores at a time)
    tanh = None
    if spec.softcap is not None:
        tanh = scores.div_(spec.softcap).tanh_()
        scores = tanh * spec.softcap
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    return scores, tanh


def _query_blocks(q_slice: slice, k_len: int, lead: int) -> list[slice]:
    # Split a chunk of queries so that each piece scores at most RING_SCORE_BLOCK pairs per (row, head).
    rows = max(1, RING_SCORE_BLOCK // max(1, k_len * lead))
    return [slice(start, min(start + rows, q_slice.stop)) for start in range(q_slice.start, q_slice.stop, rows)]


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    # Scores, softmax and sums in float32 for half-precision inputs (as flash kernels do), float64 for float64.
    return torch.promote_types(dtype, torch.float32)


def _explicit_forward(spec: _RingSpec, q, k, v, mask):
    # q [b, kv, g, sq, d], k and v [b, kv, sk, d], in the accumulation dtype -> (out [b, kv, g, sq, d], lse)
    scores, _ = _score(spec, q, k, mask)
    lse = torch.logsumexp(scores, dim=-1)  # [b, kv, g, sq]
    weights = scores.sub_(lse[..., None]).exp_().nan_to_num_(0.0)
    return weights @ v[:, :, None], lse


def _explicit_backward(spec: _RingSpec, q, k, v, dout, lse, delta, mask):
    # The block's share of (dq, dk, dv), from the whole row's lse and delta = sum(dout * out) [b, kv, g, sq].
    scores, tanh = _score(spec, q, k, mask)
    probs = scores.sub_(lse[..., None]).exp_()  # [b, kv, g, sq, sk]; 0 where masked
    dv = torch.einsum("bhgst,bhgsd->bhtd", probs, dout)
    dscores = torch.einsum("bhgsd,bhtd->bhgst", dout, v)  # d probs, then d scores in place
    dscores.sub_(delta[..., None]).mul_(probs)
    if tanh is not None:
        dscores.mul_(1 - tanh * tanh)
    dscores.mul_(spec.scale)
    return torch.einsum("bhgst,bhtd->bhgsd", dscores, k), torch.einsum("bhgst,bhgsd->bhtd", dscores, q), dv


def _fused_forward(spec: _RingSpec, q, k, v, mask, causal: bool):
    # q [b, kv, g, sq, d], k and v [b, kv, sk, d], in the inputs' dtype -> (out, lse) in the accumulation dtype.
    b, kv, g, sq, d = q.shape
    out, lse = _fused_kernel_forward(_flat_heads(q), _kv_per_head(k, g), _kv_per_head(v, g),
                                     bias=_bias(mask, q.dtype), causal=causal, scale=spec.scale)
    acc = _accumulation_dtype(q.dtype)
    out, lse = out.reshape(b, kv, g, sq, d).to(acc), lse.reshape(b, kv, g, sq).to(acc)
    if mask is not None:
        # A row that sees no key of the block contributes nothing; the kernels' log-sum-exp there is no -inf (the
        # CPU kernel's is 0), which would give its zero output weight when the blocks are combined.
        seen = mask.any(-1)  # [b or 1, 1, 1, sq]
        out = out.masked_fill(~seen[..., None], 0.0)
        lse = lse.masked_fill(~seen, float("-inf"))
    return out, lse


def _fused_backward(spec: _RingSpec, q, k, v, dout, lse, out, mask, causal: bool):
    # The kernel's backward given the whole row's output and log-sum-exp scores the block's probabilities as the
    # whole row's softmax has them and takes sum(dout * out) over the whole row: its gradients are the block's share.
    b, kv, g, sq, d = q.shape
    sk = k.shape[2]
    dq, dk, dv = _fused_kernel_backward(
        _flat_heads(dout), _flat_heads(q), _kv_per_head(k, g), _kv_per_head(v, g), _flat_heads(out),
        lse.reshape(b, kv * g, sq), bias=_bias(mask, q.dtype), causal=causal, scale=spec.scale,
    )
    # Each query head's key/value gradient goes to the key/value head its group shares.
    return dq.reshape(b, kv, g, sq, d), dk.reshape(b, kv, g, sk, d).sum(2), dv.reshape(b, kv, g, sk, d).sum(2)


def _flat_heads(x: torch.Tensor) -> torch.Tensor:
    # [b, kv, g, s, d] -> [b, kv x g, s, d], the heads in the order of the layer's query heads
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _kv_per_head(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [b, kv, sk, d] -> [b, kv x groups, sk, d]: each key/value head once per query head of its group
    b, kv, sk, d = x.shape
    return x[:, :, None].expand(b, kv, groups, sk, d).reshape(b, kv * groups, sk, d)


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # [b or 1, 1, 1, sq, sk] allowed -> [b or 1, 1, sq, sk] added to the scores: the fused kernels take no bool mask.
    if mask is None:
        return None
    return torch.zeros(mask[:, 0].shape, dtype=dtype, device=mask.device).masked_fill_(~mask[:, 0], float("-inf"))


def _fused_kernel_forward(q, k, v, *, bias, causal: bool, scale: float):
    # q [b, h, sq, d], k and v [b, h, sk, d] -> (out [b, h, sq, d], lse [b, h, sq])
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)
    if bias is None and q.dtype != torch.float32:
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
        return out, lse
    out, lse = aten._scaled_dot_product_efficient_attention(
        q, k, v, _aligned_bias(bias, q), True, 0.0, causal, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # (its log-sum-exp is kept for a multiple of 32 queries)


def _fused_kernel_backward(dout, q, k, v, out, lse, *, bias, causal: bool, scale: float):
    # The backward of _fused_kernel_forward's kernel, given the output and log-sum-exp to use -> (dq, dk, dv)
    aten = torch.ops.aten
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)
    no_dropout = torch.empty(0, dtype=torch.int64, device=q.device)  # (the dropout's random state: none is drawn)
    if bias is None and q.dtype != torch.float32:
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, no_dropout,
            no_dropout, scale=scale)
    padded = torch.nn.functional.pad(lse, (0, -q.shape[2] % 32))  # the kernel's own layout (see the forward)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _aligned_bias(bias, q), out, padded, no_dropout, no_dropout, 0.0, [True, True, True, False],
        causal, scale=scale)
    return dq, dk, dv


def _aligned_bias(bias: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor | None:
    # The memory-efficient kernel reads the bias [b, h, sq, sk] with rows a multiple of 16 elements apart.
    if bias is None:
        return None
    sk = bias.shape[-1]
    padded = bias.new_zeros(*bias.shape[:-1], sk + -sk % 16)
    padded[..., :sk] = bias
    return padded[..., :sk].expand(q.shape[0], q.shape[1], q.shape[2], sk)


def _attend_source(spec: _RingSpec, q, k, v, source: int, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Adds this rank's queries ``q`` ``[b, kv, g, s, d]`` attending to rank ``source``'s keys and values ``k``, ``v``
    ``[b, kv, s, d]`` to the running output ``out`` and log-sum-exp ``lse`` ``[b, kv, g, s]`` (in place)."""
    b, kv, g = q.shape[:3]
    for rows, k_sl, mask, causal in spec.blocks(source, batch=b, heads=kv * g, device=q.device):
        if spec.fused:
            part, part_lse = _fused_forward(spec, q[:, :, :, rows], k[:, :, k_sl], v[:, :, k_sl], mask, causal)
        else:
            part, part_lse = _explicit_forward(spec, q[:, :, :, rows], k[:, :, k_sl], v[:, :, k_sl], mask)
        new_lse = torch.logaddexp(lse[..., rows], part_lse)
        keep = torch.exp(lse[..., rows] - new_lse).nan_to_num_(0.0)
        gain = torch.exp(part_lse - new_lse).nan_to_num_(0.0)
        out[..., rows, :] = out[..., rows, :] * keep[..., None] + part * gain[..., None]
        lse[..., rows] = new_lse


def _add_source_grads(spec: _RingSpec, q, dout, out, lse, delta, k, v, source: int, dq, dk, dv) -> None:
    """Adds the gradients of attending with rank ``source``'s keys and values ``k``, ``v`` to ``dq`` and to that rank's
    ``dk``, ``dv`` (in place), given the whole row's ``out`` and ``lse`` (and ``delta`` for the explicit kernel)."""
    b, kv, g = q.shape[:3]
    for rows, k_sl, mask, causal in spec.blocks(source, batch=b, heads=kv * g, device=q.device):
        inputs = (q[:, :, :, rows], k[:, :, k_sl], v[:, :, k_sl], dout[:, :, :, rows], lse[..., rows])
        if spec.fused:
            dq_part, dk_part, dv_part = _fused_backward(spec, *inputs, out[..., rows, :], mask, causal)
        else:
            dq_part, dk_part, dv_part = _explicit_backward(spec, *inputs, delta[..., rows], mask)
        dq[:, :, :, rows] += dq_part
        dk[:, :, k_sl] += dk_part
        dv[:, :, k_sl] += dv_part


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: _RingSpec):
        cp, dtype = spec.cp, q.dtype
        acc = _accumulation_dtype(dtype)
        # The explicit kernel scores in the accumulation dtype; a fused kernel takes the inputs as they are (and the
        # ring passes them so).
        qf, kf, vf = (q, k, v) if spec.fused else (q.to(acc), k.to(acc), v.to(acc))
        out = torch.zeros(q.shape, device=q.device, dtype=acc)  # [b, kv, g, s, d]
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=acc)  # [b, kv, g, s]
        ring = _Ring(cp)
        block = (kf, vf)
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            pending = ring.pass_on(block) if step < cp.size - 1 else None
            _attend_source(spec, qf, *block, source, out, lse)
            if pending is not None:
                block = pending()
        result = out.to(dtype)
        ctx.spec = spec
        # A fused kernel's backward takes the output in the inputs' dtype, the explicit one its accumulated sums.
        ctx.save_for_backward(q, k, v, result if spec.fused else out, lse)
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        spec = ctx.spec
        cp = spec.cp
        q, k, v, out, lse = ctx.saved_tensors
        acc = _accumulation_dtype(q.dtype)
        if spec.fused:
            qf, dout, kv, delta = q, grad_out.to(q.dtype), (k, v), None  # (the kernel computes its delta itself)
        else:
            qf, dout, kv = q.to(acc), grad_out.to(acc), (k.to(acc), v.to(acc))
            delta = (dout * out).sum(-1)  # [b, kv, g, s]
        dq = torch.zeros(q.shape, device=q.device, dtype=acc)
        ring = _Ring(cp)
        grads = (torch.zeros(k.shape, device=k.device, dtype=acc), torch.zeros(v.shape, device=v.device, dtype=acc))
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            pending = ring.pass_on(kv) if step < cp.size - 1 else None  # the next block travels meanwhile
            _add_source_grads(spec, qf, dout, out, lse, delta, *kv, source, dq, *grads)
            # This block's gradients, with this rank's share added, follow the block; after cp moves they are home.
            grads = ring.pass_on(grads)()
            if pending is not None:
                kv = pending()
        dk, dv = grads
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class _Ring:
    """Sends tensors to the next CP rank and receives the previous rank's, without blocking until asked."""

    def __init__(self, cp: ContextParallel) -> None:
        self.group = cp.group
        self.next = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
        self.prev = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)

    def pass_on(self, tensors: tuple[torch.Tensor, ...]) -> Callable[[], tuple[torch.Tensor, ...]]:
        if self.next == self.prev == dist.get_rank():  # a ring of one
            return lambda: tensors
        flat = torch.cat([t.reshape(-1) for t in tensors])  # one message per step
        received = torch.empty_like(flat)
        ops = [dist.P2POp(dist.isend, flat, self.next, self.group), dist.P2POp(dist.irecv, received, self.prev, self.group)]
        works = dist.batch_isend_irecv(ops)

        def wait() -> tuple[torch.Tensor, ...]:
            for work in works:
                work.wait()
            parts, start = [], 0
            for t in tensors:
                parts.append(received[start:start + t.numel()].view_as(t))
                start += t.numel()
            return tuple(parts)

        return wait
