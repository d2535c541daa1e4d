"""Token cross-entropy sums over the vocabulary, in float32, without holding the float32 logits of a batch.

Three forms, from the most general to the lightest (and, for preference losses, two that give each row's summed
log-probability instead: :func:`chunked_sequence_logprobs` and :func:`linear_sequence_logprobs`):

- :func:`cross_entropy_sum`: from whole logits ``[b, s, vocab]``.
- :func:`chunked_cross_entropy_sum`: from logits given in sequence chunks; one chunk at a time is in float32, but
  every chunk's logits stay alive, in the model's dtype, from forward to backward.
- :func:`linear_cross_entropy_sum`: from the final hidden states and the output weight. The projection and the
  loss run together, chunk by chunk, and each chunk's gradients (of the hidden states and of the weight, and of a
  LoRA adapter's on it) are computed right there, in the forward pass, from the chunk's softmax. No logits outlive
  their chunk, and the backward pass only scales the gradients it was left. It costs no extra matmul: the two
  gradient matmuls are the ones autograd would run in backward, run earlier. Positions whose label is ignored
  (prompt, padding) get no logits at all.

All return the *sum* over non-ignored positions; the training loop divides by the global token count
(``toolkit.training.accumulation``).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from toolkit.modules.masks import CROSS_ENTROPY_IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies, in float32, over the non-ignored positions.

    Args:
        logits: ``[b, s, vocab]``.
        labels: ``[b, s]``, already shifted (``labels[:, i]`` is the target at position ``i``).
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


def _softmax_minus_one_hot_(probs: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Turn float32 softmax rows ``[m, vocab]`` into the loss gradient ``softmax - one_hot(label)``, in place; rows
    whose label is ``ignore_index`` become zero."""
    labels = labels.reshape(-1, 1)
    kept = labels != ignore_index
    # Ignored positions scatter 0 into column 0 (their label is not an index), then are zeroed by `kept`.
    probs.scatter_add_(1, torch.where(kept, labels, 0), -kept.to(probs.dtype))
    return probs.mul_(kept)


class _ChunkCrossEntropySum(torch.autograd.Function):
    """Summed float32 cross-entropy of one chunk of logits that keeps no float32 tensor for the backward.

    Autograd's own ``cross_entropy(logits.float())`` saves the float32 log-softmax from forward to backward and
    makes three more chunk-sized float32 tensors in backward (the upcast, the NLL gradient, the log-softmax
    gradient). Here the forward saves only the chunk as given (the model's dtype), and the backward recomputes
    its softmax in float32 and turns it, in place, into the gradient ``softmax - one_hot(label)``: one float32
    chunk at a time in either pass, for the price of recomputing a softmax (no matmul).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        ctx.save_for_backward(logits, labels)
        ctx.ignore_index = ignore_index
        vocab = logits.shape[-1]
        log_probs = torch.log_softmax(logits.reshape(-1, vocab), dim=-1, dtype=torch.float32)  # [b * s_i, vocab]
        return F.nll_loss(log_probs, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, labels = ctx.saved_tensors
        grad = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1, dtype=torch.float32)
        grad = _softmax_minus_one_hot_(grad, labels, ctx.ignore_index).mul_(grad_loss)
        return grad.view_as(logits).to(logits.dtype), None, None


def chunked_cross_entropy_sum(
    chunks: Sequence[torch.Tensor], labels: torch.Tensor, *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX
) -> torch.Tensor:
    """:func:`cross_entropy_sum` of logits given as sequence chunks, in float32 one chunk at a time.

    Takes the output of ``model(tokens, num_output_chunks=n)``. The float32 logits of the whole micro-batch
    (``[b, s, vocab]``: 4 GiB for one 8k-token Llama 3 sequence) never exist, in forward or backward: at most
    one chunk's float32 softmax does. What stays alive from forward to backward is the chunks themselves, in the
    model's dtype, each freed once its gradient is computed (if the caller drops its reference to them).

    Args:
        chunks: logits ``[b, s_i, vocab]`` covering the sequence in order.
        labels: ``[b, s]``, already shifted; split to the chunks' lengths.

    Raises:
        ValueError: the chunks' lengths do not add up to the labels' sequence length.
    """
    sizes = [chunk.shape[1] for chunk in chunks]
    if sum(sizes) != labels.shape[1]:
        raise ValueError(f"logit chunks of lengths {sizes} do not cover labels of sequence length {labels.shape[1]}")
    losses = [
        _ChunkCrossEntropySum.apply(chunk, chunk_labels, ignore_index)
        for chunk, chunk_labels in zip(chunks, labels.split(sizes, dim=1))
    ]
    return torch.stack(losses).sum()


def chunked_sequence_logprobs(
    chunks: Sequence[torch.Tensor], labels: torch.Tensor, *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX
) -> torch.Tensor:
    """Each row's summed float32 log-probability of its labels (``[b]``) from logits given as sequence chunks (as
    :func:`chunked_cross_entropy_sum` takes them; autograd's own backward, one chunk upcast at a time): the path of
    an output layer the fused :func:`linear_sequence_logprobs` cannot take."""
    sizes = [chunk.shape[1] for chunk in chunks]
    if sum(sizes) != labels.shape[1]:
        raise ValueError(f"logit chunks of lengths {sizes} do not cover labels of sequence length {labels.shape[1]}")
    total = torch.zeros(labels.shape[0], dtype=torch.float32, device=labels.device)
    for chunk, chunk_labels in zip(chunks, labels.split(sizes, dim=1)):
        token_losses = F.cross_entropy(
            chunk.float().flatten(0, 1), chunk_labels.flatten(), ignore_index=ignore_index, reduction="none"
        )
        total = total - token_losses.view(chunk_labels.shape).sum(dim=1)
    return total


# --- The projection and the loss together -------------------------------------------------------------------------


def logit_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, softcap: float | None, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The summed float32 cross-entropy of one chunk of raw logits ``[m, vocab]`` against ``labels`` ``[m]``, all
    of them targets (:func:`linear_cross_entropy_sum` drops the ignored positions first), and (if ``need_grad``)
    its gradient with respect to the logits, in their dtype.

    With ``softcap`` the logits are first soft-capped to ``softcap * tanh(logits / softcap)`` (Gemma 2), and the
    gradient is taken through the cap. This is the part of :func:`linear_cross_entropy_sum` between the matmuls:
    ``torch.compile`` fuses it into a pass or two over the chunk (``toolkit.training.compile_model`` does).
    """
    dtype, tanh = logits.dtype, None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        logits = tanh * softcap
    targets = labels.unsqueeze(1)  # [m, 1]
    loss = -torch.log_softmax(logits, dim=-1, dtype=torch.float32).gather(1, targets).sum()
    if not need_grad:
        return loss, None
    # softmax - one_hot(label), in place. The softmax is taken again from the logits rather than as the exp of the
    # log-softmax: the same memory (the log-softmax is freed first), and on CPU torch.exp takes a slow path on the
    # very negative log-probabilities of a trained model's vocabulary (10x slower than the softmax at -350, 1.6x at
    # -15), where the softmax kernel does not.
    grad = torch.softmax(logits, dim=-1, dtype=torch.float32)
    del logits
    grad.scatter_add_(1, targets, torch.full_like(targets, -1, dtype=grad.dtype))
    if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        grad.mul_(tanh.square_().neg_().add_(1))
    return loss, grad.to(dtype)


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's columns of the logits sit in a vocabulary split over ``group``: tokens ``start`` to
    ``start + size`` (the local rows of the output weight)."""

    group: dist.ProcessGroup
    start: int
    size: int


def vocab_parallel_loss_and_grad(
    logits: torch.Tensor, labels: torch.Tensor, softcap: float | None, need_grad: bool, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`logit_loss_and_grad` of logits of which this rank holds the columns ``shard`` (``[m, shard.size]``):
    the same loss, the sum over the whole vocabulary, on every rank of ``shard.group``, and this rank's columns of
    its gradient.

    The softmax needs the row maxima and sums over the whole vocabulary, and the loss the label's logit, held by
    one rank: each rank reduces its own, then two all-reduces (the maxima, then the sums with the label logits
    together) give every rank the whole row's. Communication is ``3 m`` floats per chunk, whatever the vocabulary.
    """
    dtype, tanh = logits.dtype, None
    if softcap is not None:
        tanh = torch.tanh(logits / softcap)
        logits = tanh * softcap
    row_max = logits.amax(dim=1).float()  # [m]
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=shard.group)
    shifted = logits.float() - row_max.unsqueeze(1)  # [m, v]: float32, at most 0
    del logits
    local = labels - shard.start
    owned = (local >= 0) & (local < shard.size)
    local = torch.where(owned, local, 0).unsqueeze(1)  # [m, 1]
    label_logit = torch.where(owned, shifted.gather(1, local).squeeze(1), 0.0)  # minus the max; 0 elsewhere
    sum_exp = shifted.exp_().sum(dim=1)  # shifted now holds exp(logit - max)
    sums = torch.stack([sum_exp, label_logit])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=shard.group)  # the whole rows': [sum of exp, label logit]
    loss = (sums[0].log() - sums[1]).sum()
    if not need_grad:
        return loss, None
    grad = shifted.div_(sums[0].unsqueeze(1))  # the softmax's columns of this rank
    grad.scatter_add_(1, local, -owned.to(grad.dtype).unsqueeze(1))  # minus one-hot, where the label is here
    if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        grad.mul_(tanh.square_().neg_().add_(1))
    return loss, grad.to(dtype)


def local_vocab_shard(tensor: torch.Tensor | None) -> tuple[torch.Tensor | None, VocabShard | None]:
    """A DTensor split over the vocabulary (its rows, on a 1-D mesh) as its local rows and where they sit; a plain
    tensor as itself."""
    if not isinstance(tensor, DTensor):
        return tensor, None
    mesh = tensor.device_mesh
    if mesh.ndim != 1 or tensor.placements != (Shard(0),):
        raise ValueError(f"a split output weight must be split over its rows on a 1-D mesh, not {tensor.placements}")
    local = tensor.to_local()
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    return local, VocabShard(group=mesh.get_group(), start=offset[0], size=local.shape[0])


def _replicated_local(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


LogitKernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(frozen=True)
class LoRAAdapter:
    """A low-rank adapter on the output projection (:class:`~toolkit.modules.peft.LoRALinear`'s): the logits are
    ``h @ weight.T + scale * (x @ lora_a.T) @ lora_b.T``.

    Attributes:
        lora_a: ``A``, ``[rank, d]``.
        lora_b: ``B``, ``[vocab, rank]``.
        scale: ``alpha / rank``.
        x: the adapter's input, ``h``'s shape: ``h`` after the adapter's dropout, or ``h`` itself (the same tensor)
            without dropout, whose gradient is then added into ``h``'s rather than kept as a second one. Dropout is
            applied by the caller, once over the whole ``h``, so that its backward applies its own mask and it draws
            the same mask as the layer's own forward.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float
    x: torch.Tensor


def _chunked_projection_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor | None,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    labels: torch.Tensor,
    scale: float,
    *,
    sizes: Sequence[int],
    softcap: float | None,
    kernel: LogitKernel,
    needs: Sequence[bool],
    shard: VocabShard | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Loss sums of ``h @ weight.T`` (plus, with ``lora_a``, ``scale * (x @ lora_a.T) @ lora_b.T``, ``x`` None
    meaning ``h``) against ``labels`` (``h``, ``x`` ``[t, d]``, ``weight`` ``[vocab, d]``, ``lora_a`` ``[r, d]``,
    ``lora_b`` ``[vocab, r]``, all in one dtype; ``labels`` ``[t]``, every one a target), one per chunk of ``sizes``
    rows (float32, ``[len(sizes)]``), with the gradients ``needs`` asks for, in the order ``h, weight, x, lora_a,
    lora_b``, for a loss of 1 (or, with ``weights`` ``[len(sizes)]``, of the chunks' losses weighted by it), in that
    dtype (the weights' accumulated over chunks, as autograd accumulates a weight used once per chunk). With
    ``x`` None the adapter's input gradient is added into ``h``'s.

    With ``shard``, ``weight`` and ``lora_b`` hold this rank's rows of a vocabulary split over ``shard.group``
    (``lora_a``, ``h`` and ``x`` are the same on every rank of it): the loss is the whole vocabulary's, the weights'
    gradients this rank's rows, and the gradients of what every rank shares (``h``, ``x``, ``lora_a``), each rank's
    share of them, summed over the group once at the end."""
    need_h, need_weight, need_x, need_a, need_b = needs
    loss_and_grad = kernel if shard is None else partial(vocab_parallel_loss_and_grad, shard=shard)
    # The rows' gradients are written chunk by chunk; the weights' are summed over the chunks.
    grad_h, grad_x = (torch.empty_like(t) if need else None for t, need in ((h, need_h), (x, need_x)))
    grad_weight, grad_a, grad_b = (
        torch.empty_like(t) if need else None for t, need in ((weight, need_weight), (lora_a, need_a), (lora_b, need_b))
    )
    beta = 0  # the first chunk writes the weights' gradients (no pass filling them with zeros), the others add
    losses = torch.zeros(len(sizes), dtype=torch.float32, device=h.device)
    need_grad = any(needs)

    def split(t: torch.Tensor | None) -> Sequence[torch.Tensor | None]:
        return t.split(list(sizes)) if t is not None else [None] * len(sizes)

    for k, (rows, chunk_labels, adapter_rows, chunk_grad_h, chunk_grad_x) in enumerate(zip(
        split(h), split(labels), split(x), split(grad_h), split(grad_x)
    )):
        if rows.shape[0] == 0:
            continue
        adapter_rows = rows if adapter_rows is None else adapter_rows
        u = adapter_rows @ lora_a.T if lora_a is not None else None  # [m, r]
        # The logits are made inside the call, so that the kernel holds their only reference and can free them.
        # (A logits variable here would hold them through the kernel: a whole chunk's logits more at its peak.)
        chunk_loss, grad = loss_and_grad(
            rows @ weight.T if u is None else (rows @ weight.T).addmm_(u, lora_b.T, alpha=scale),
            chunk_labels, softcap, need_grad,
        )
        losses[k] = chunk_loss
        if weights is not None and grad is not None:
            grad.mul_(weights[k].to(grad.dtype))
        if need_h:
            torch.mm(grad, weight, out=chunk_grad_h)
        if need_weight:
            grad_weight.addmm_(grad.T, rows, beta=beta)
        if u is not None and need_grad:
            if need_b:
                grad_b.addmm_(grad.T, u, beta=beta, alpha=scale)
            grad_u = grad @ lora_b  # [m, r], the gradient of u over scale
            if need_a:
                grad_a.addmm_(grad_u.T, adapter_rows, beta=beta, alpha=scale)
            if need_x:
                chunk_grad_x.addmm_(grad_u, lora_a, beta=0, alpha=scale)
            elif x is None and need_h:
                chunk_grad_h.addmm_(grad_u, lora_a, alpha=scale)
        del grad
        beta = 1
    if beta == 0:  # no rows: nothing was written
        for grad in (grad_weight, grad_a, grad_b):
            if grad is not None:
                grad.zero_()
    if shard is not None:
        for grad in (grad_h, grad_x, grad_a):  # (every rank of the group needs the same ones, in the same order)
            if grad is not None:
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=shard.group)
    return losses, [grad_h, grad_weight, grad_x, grad_a, grad_b]


def _even_sizes(total: int, num_chunks: int) -> list[int]:
    # As tensor_split cuts ``total`` rows into ``num_chunks``: the first ``total % num_chunks`` one row longer.
    base, longer = divmod(total, num_chunks)
    return [base + 1] * longer + [base] * (num_chunks - longer)


class _LinearCrossEntropySum(torch.autograd.Function):
    """:func:`_chunked_projection_loss` as an autograd function: the gradients it computes in forward are saved
    and, in backward, scaled by the incoming gradient of the loss."""

    @staticmethod
    def forward(ctx, h, weight, x, lora_a, lora_b, labels, scale, num_chunks, softcap, kernel, shard):
        losses, grads = _chunked_projection_loss(
            h, weight, x, lora_a, lora_b, labels, scale, sizes=_even_sizes(h.shape[0], num_chunks), softcap=softcap,
            kernel=kernel, needs=ctx.needs_input_grad[:5], shard=shard,
        )
        ctx.save_for_backward(*grads)
        return losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        # Scaled in place: this function's gradients are used once (a second backward through it is an error).
        grads = [grad.mul_(grad_loss) if grad is not None else None for grad in ctx.saved_tensors]
        return *grads, None, None, None, None, None, None


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    adapter: LoRAAdapter | None = None,
    num_chunks: int = 8,
    softcap: float | None = None,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    kernel: LogitKernel = logit_loss_and_grad,
) -> torch.Tensor:
    """Summed float32 cross-entropy of the logits ``h @ weight.T`` (with a LoRA ``adapter``'s term added, and
    optionally soft-capped), never holding them.

    The non-ignored positions are projected ``num_chunks`` groups of rows at a time. For each group the logits,
    their float32 softmax and its gradient exist only while that group is processed; when gradients are wanted
    they are multiplied into the hidden states' and the weights' gradients right away. What outlives the forward
    pass is those gradients (``[t, d]``, ``[vocab, d]`` if the weight is trained, and the adapter's: its input's,
    ``[t, d]`` when that is not ``h``, and ``A``'s and ``B``'s), to be scaled in backward. The adapter adds only
    rank-sized matmuls. The matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would), else in
    the weight's dtype; the gradients come back in the inputs' dtypes.

    Finding the non-ignored positions reads the labels on the host (one device synchronization).

    Under tensor parallelism ``weight`` is a DTensor split over the vocabulary (its rows, on a 1-D mesh), and so is
    an adapter's ``lora_b`` (``lora_a`` replicated): each rank projects only its rows, and the loss is reduced over
    the mesh's group (:func:`vocab_parallel_loss_and_grad`), the same on every rank. Every rank of the group must
    call it with the same ``h`` and ``labels``.

    Args:
        h: final hidden states ``[..., d]``.
        weight: the output projection ``[vocab, d]`` (plain data: no bias, no quantization), or its vocabulary
            shard as a DTensor.
        labels: ``h.shape[:-1]``, already shifted.
        adapter: a LoRA adapter on the projection (its tensors plain too, or DTensors split like ``weight``).
        num_chunks: groups the positions are processed in (more: less memory, smaller matmuls).
        softcap: Gemma 2's ``final_logit_softcap``.
        kernel: :func:`logit_loss_and_grad` or a compiled version of it (a split vocabulary takes
            :func:`vocab_parallel_loss_and_grad` instead).
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be at least 1, got {num_chunks}")
    inputs, labels, _, scale, shard = _projection_inputs(h, weight, labels, adapter, ignore_index)
    with torch.autocast(h.device.type, enabled=False):
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
            return _LinearCrossEntropySum.apply(*inputs, labels, scale, num_chunks, softcap, kernel, shard)
        losses, _ = _chunked_projection_loss(
            *inputs, labels, scale, sizes=_even_sizes(labels.shape[0], num_chunks), softcap=softcap, kernel=kernel,
            needs=[False] * 5, shard=shard,
        )
        return losses.sum()


def _projection_inputs(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, adapter: LoRAAdapter | None, ignore_index: int
) -> tuple[list[torch.Tensor | None], torch.Tensor, torch.Tensor, float, VocabShard | None]:
    """``h``, ``weight``, the adapter's input and factors (local parts, in the compute dtype), the labels, at the
    non-ignored positions only (which ``kept`` lists, flat), the adapter's scale and the vocabulary shard."""
    width = h.shape[-1]
    x = None if adapter is None or adapter.x is h else adapter.x.reshape(-1, width)
    h, labels = h.reshape(-1, width), labels.reshape(-1)
    kept = (labels != ignore_index).nonzero().squeeze(1)  # the one synchronization: its size is data
    if kept.numel() < labels.numel():  # no logits for prompt or padding positions
        h, labels = h.index_select(0, kept), labels.index_select(0, kept)
        x = x.index_select(0, kept) if x is not None else None
    device_type = h.device.type
    weight, shard = local_vocab_shard(weight)  # differentiable: the gradients reach the DTensors
    lora = (None, None)
    if adapter is not None:
        lora = (_replicated_local(adapter.lora_a), local_vocab_shard(adapter.lora_b)[0])
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    scale = adapter.scale if adapter is not None else 0.0
    return [t.to(dtype) if t is not None else None for t in (h, weight, x, *lora)], labels, kept, scale, shard


# --- Per-sequence log-probabilities (preference losses) ------------------------------------------------------------


class _LinearSequenceLogprobs(torch.autograd.Function):
    """Per-row summed label log-probabilities of ``h @ weight.T`` (and an adapter's term), chunk by chunk, with the
    chunks cut at row ends. A loss of the rows' values (a preference loss) weighs each row's tokens differently,
    which only backward knows: it projects each chunk again and takes its gradient there, weighted by its row's
    incoming gradient. One projection more than the summed loss, and still no logits outlive their chunk."""

    @staticmethod
    def forward(ctx, h, weight, x, lora_a, lora_b, labels, scale, sizes, rows, num_rows, softcap, kernel, shard):
        with torch.no_grad():
            losses, _ = _chunked_projection_loss(
                h, weight, x, lora_a, lora_b, labels, scale, sizes=sizes, softcap=softcap, kernel=kernel,
                needs=[False] * 5, shard=shard,
            )
        ctx.save_for_backward(h, weight, x, lora_a, lora_b, labels, rows)
        ctx.settings = (scale, sizes, softcap, kernel, shard)
        return torch.zeros(num_rows, dtype=torch.float32, device=h.device).index_add_(0, rows, -losses)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        h, weight, x, lora_a, lora_b, labels, rows = ctx.saved_tensors
        scale, sizes, softcap, kernel, shard = ctx.settings
        # A chunk's log-probability is minus its loss: its gradient weighs the loss's by minus its row's.
        _, grads = _chunked_projection_loss(
            h, weight, x, lora_a, lora_b, labels, scale, sizes=sizes, softcap=softcap, kernel=kernel,
            needs=ctx.needs_input_grad[:5], shard=shard, weights=-grad_rows.float()[rows],
        )
        return *grads, None, None, None, None, None, None, None, None


def linear_sequence_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    adapter: LoRAAdapter | None = None,
    chunk_size: int = 1024,
    softcap: float | None = None,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    kernel: LogitKernel = logit_loss_and_grad,
) -> torch.Tensor:
    """The summed float32 log-probability of each row's labels under the logits ``h @ weight.T`` (with a LoRA
    ``adapter``'s term, optionally soft-capped), ``[b]``, never holding the logits; what preference losses (DPO
    and kin) compare.

    As :func:`linear_cross_entropy_sum`, with every chunk within one row (at most ``chunk_size`` positions), and the
    gradients computed in backward, where each row's weight is known, by projecting each chunk once more
    (:class:`_LinearSequenceLogprobs`). A row without labels gets 0. Tensor parallelism as there.

    Args:
        h: final hidden states ``[b, s, d]``.
        weight: the output projection ``[vocab, d]``, or its vocabulary shard as a DTensor.
        labels: ``[b, s]``, already shifted.
        adapter, softcap, ignore_index, kernel: as :func:`linear_cross_entropy_sum`'s.
        chunk_size: the most positions one chunk projects.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    num_rows, seq_len = labels.shape
    inputs, kept_labels, kept, scale, shard = _projection_inputs(h, weight, labels, adapter, ignore_index)
    # Chunks within rows: each row's positions cut into pieces of at most chunk_size.
    counts = torch.bincount(kept // seq_len, minlength=num_rows).tolist()
    sizes, chunk_rows = [], []
    for row, count in enumerate(counts):
        if count:  # (a row without labels has no chunk, and stays 0)
            pieces = -(-count // chunk_size)
            sizes += _even_sizes(count, pieces)
            chunk_rows += [row] * pieces
    rows = torch.tensor(chunk_rows, dtype=torch.long, device=h.device)
    with torch.autocast(h.device.type, enabled=False):
        return _LinearSequenceLogprobs.apply(
            *inputs, kept_labels, scale, sizes, rows, num_rows, softcap, kernel, shard
        )
