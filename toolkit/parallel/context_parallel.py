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
  and sends the key/value gradients round the ring after their blocks. Scores are computed in float32 (float64 for
  float64 inputs) for one chunk of queries at a time (the memory stays bounded at any length), fully masked chunk pairs are skipped.

Both are exact: the outputs and gradients equal single-process attention over the whole row up to float
rounding (``tests/modules/test_context_parallel.py`` checks float64 against SDPA).

**Where CP ranks sit.** They are data-parallel ranks that read the same samples: FSDP2 or DDP reduce their
gradients like any other data-parallel rank's (each holds the gradient of its positions' share of the loss), so
the data-parallel mesh and strategies are unchanged and ``dp_size`` still counts them. The sampler and the batch
arithmetic count ``dp_size / cp`` ranks (:attr:`~toolkit.parallel.ParallelDims.batch_ranks`). The ring and the
all-to-all run over the ``cp`` dimension of the mesh ``(batch, cp, tp)`` over the same ranks
(:meth:`~toolkit.parallel.ParallelDims.context_parallel`): ``cp`` consecutive data-parallel ranks, tensor
parallelism inside each. That is DESIGN.md's rank order ``dp_replicate x dp_shard x cp x tp``, held as two meshes
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

from toolkit.data.packing import document_ids
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
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    method: str = "ring"

    def local(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's positions of ``rows`` ``[b, s, ...]``."""
        return rows[:, local_positions(rows.shape[1], cp=self.size, rank=self.rank, device=rows.device)]

    def shard(self, batch: dict[str, torch.Tensor], *, full_mask: Callable[[dict], object] | None = None):
        """This rank's part of a micro-batch (on its device), and the ``mask`` to give the decoder with it.

        ``tokens``, ``labels`` and ``input_pos`` (positions restarting at every packed document; the row positions
        where the batch has none) keep only :func:`local_positions`. ``full_mask(batch)`` builds the whole row's
        attention mask, which ``alltoall`` attends with (the trainer's
        :func:`~toolkit.training.attention.batch_attention_mask`).
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
        return local, RingAttention(self, seq_len=seq_len, document_ids=docs)


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
    """``ring``: key/value blocks passed round the CP ranks, partial softmaxes combined by log-sum-exp."""

    def __init__(self, cp: ContextParallel, *, seq_len: int, document_ids: torch.Tensor | None) -> None:
        self.cp = cp
        self.seq_len = seq_len
        self.document_ids = document_ids

    def attend(self, layer: GroupedQueryAttention, q, k, v):
        b, h, s, d = q.shape
        groups = h // k.shape[1]
        scale = layer.softmax_scale if layer.softmax_scale is not None else layer.head_dim**-0.5
        spec = _RingSpec(
            cp=self.cp, seq_len=self.seq_len, document_ids=self.document_ids, scale=scale,
            window=layer.sliding_window, softcap=layer.logit_softcap,
        )
        q5 = q.reshape(b, k.shape[1], groups, s, d)  # [b, kv heads, groups, s, d]: GQA without copying k and v
        # Its float32 sums are its own: autocast (mixed precision) would run them in bfloat16.
        with torch.autocast(q.device.type, enabled=False):
            out = _RingFunction.apply(q5, k, v, spec)
        return out.reshape(b, h, s, d)


@dataclass(frozen=True)
class _RingSpec:
    cp: ContextParallel
    seq_len: int
    document_ids: torch.Tensor | None
    scale: float
    window: int | None
    softcap: float | None

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

    def blocks(self, kv_rank: int, *, lead: int, device: torch.device):
        """``(local query rows, local key slice, mask)`` for every block of this rank's queries against ``kv_rank``'s
        keys that has a key its query may see: the chunk pairs, each cut into pieces of at most
        :data:`RING_SCORE_BLOCK` scores per ``lead`` (batch x heads)."""
        for q_sl, k_sl, q0, k0, whole in self.pairs(kv_rank):
            k_rows = k0 + torch.arange(k_sl.stop - k_sl.start, device=device)
            for rows in _query_blocks(q_sl, k_sl.stop - k_sl.start, lead):
                if whole and self.document_ids is None:
                    yield rows, k_sl, None
                    continue
                q_rows = q0 + torch.arange(rows.start - q_sl.start, rows.stop - q_sl.start, device=device)
                yield rows, k_sl, self.mask(q_rows, k_rows)

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


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec: _RingSpec):
        cp, dtype = spec.cp, q.dtype
        acc = _accumulation_dtype(q.dtype)
        qf, kf, vf = q.to(acc), k.to(acc), v.to(acc)
        out = torch.zeros_like(qf)  # [b, kv, g, s, d]
        lse = torch.full(qf.shape[:-1], float("-inf"), device=q.device, dtype=acc)  # [b, kv, g, s]
        ring = _Ring(cp)
        block = (kf, vf)
        lead = qf.shape[0] * qf.shape[1] * qf.shape[2]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            pending = ring.pass_on(block) if step < cp.size - 1 else None
            k_b, v_b = block
            for rows, k_sl, mask in spec.blocks(source, lead=lead, device=q.device):
                scores, _ = _score(spec, qf[:, :, :, rows], k_b[:, :, k_sl], mask)
                part_lse = torch.logsumexp(scores, dim=-1)  # [b, kv, g, rows]
                weights = scores.sub_(part_lse[..., None]).exp_().nan_to_num_(0.0)
                part = weights @ v_b[:, :, None, k_sl]
                new_lse = torch.logaddexp(lse[..., rows], part_lse)
                keep = torch.exp(lse[..., rows] - new_lse).nan_to_num_(0.0)
                gain = torch.exp(part_lse - new_lse).nan_to_num_(0.0)
                out[..., rows, :] = out[..., rows, :] * keep[..., None] + part * gain[..., None]
                lse[..., rows] = new_lse
            if pending is not None:
                block = pending()
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        spec = ctx.spec
        cp = spec.cp
        q, k, v, out, lse = ctx.saved_tensors
        acc = _accumulation_dtype(q.dtype)
        qf, dout = q.to(acc), grad_out.to(acc)
        delta = (dout * out).sum(-1)  # [b, kv, g, s]
        dq = torch.zeros_like(qf)
        ring = _Ring(cp)
        kv = (k.to(acc), v.to(acc))
        grads = (torch.zeros_like(kv[0]), torch.zeros_like(kv[1]))
        lead = qf.shape[0] * qf.shape[1] * qf.shape[2]
        for step in range(cp.size):
            source = (cp.rank - step) % cp.size
            pending = ring.pass_on(kv) if step < cp.size - 1 else None  # the next block travels meanwhile
            (k_b, v_b), (dk_b, dv_b) = kv, grads
            for rows, k_sl, mask in spec.blocks(source, lead=lead, device=q.device):
                k_part, v_part = k_b[:, :, k_sl], v_b[:, :, k_sl]
                scores, tanh = _score(spec, qf[:, :, :, rows], k_part, mask)
                probs = scores.sub_(lse[..., rows, None]).exp_()  # [b, kv, g, rows, sk]; 0 where masked
                d_rows = dout[:, :, :, rows]
                dv_b[:, :, k_sl] += torch.einsum("bhgst,bhgsd->bhtd", probs, d_rows)
                dscores = torch.einsum("bhgsd,bhtd->bhgst", d_rows, v_part)  # d probs, then d scores in place
                dscores.sub_(delta[..., rows, None]).mul_(probs)
                if tanh is not None:
                    dscores.mul_(1 - tanh * tanh)
                dscores.mul_(spec.scale)
                dq[:, :, :, rows] += torch.einsum("bhgst,bhtd->bhgsd", dscores, k_part)
                dk_b[:, :, k_sl] += torch.einsum("bhgst,bhgsd->bhtd", dscores, qf[:, :, :, rows])
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
