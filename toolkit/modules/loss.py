"""Token cross-entropy sums over the vocabulary, in float32, without holding the float32 logits of a batch.

Three forms, from the most general to the lightest:

- :func:`cross_entropy_sum`: from whole logits ``[b, s, vocab]``.
- :func:`chunked_cross_entropy_sum`: from logits given in sequence chunks; one chunk at a time is in float32, but
  every chunk's logits stay alive, in the model's dtype, from forward to backward.
- :func:`linear_cross_entropy_sum`: from the final hidden states and the output weight. The projection and the
  loss run together, chunk by chunk, and each chunk's gradients (of the hidden states and of the weight) are
  computed right there, in the forward pass, from the chunk's softmax. No logits outlive their chunk, and the
  backward pass only scales the gradients it was left. It costs no extra matmul: the two gradient matmuls are the
  ones autograd would run in backward, run earlier. Positions whose label is ignored (prompt, padding) get no
  logits at all.

All return the *sum* over non-ignored positions; the training loop divides by the global token count
(``toolkit.training.loss``).
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX


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
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    del logits
    targets = labels.unsqueeze(1)  # [m, 1]
    loss = -log_probs.gather(1, targets).sum()
    if not need_grad:
        return loss, None
    grad = log_probs.exp_()  # softmax - one_hot(label), in place
    grad.scatter_add_(1, targets, torch.full_like(targets, -1, dtype=grad.dtype))
    if tanh is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2
        grad.mul_(tanh.square_().neg_().add_(1))
    return loss, grad.to(dtype)


LogitKernel = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def _chunked_projection_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_chunks: int,
    softcap: float | None,
    kernel: LogitKernel,
    need_h: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Loss sum of ``h @ weight.T`` against ``labels`` (``h`` ``[t, d]``, ``weight`` ``[vocab, d]`` in the same
    dtype, ``labels`` ``[t]``, every one a target), chunk by chunk over the rows, with the gradients asked for: ``[t, d]`` and
    ``[vocab, d]`` in that dtype, for a loss of 1 (the weight's accumulated over chunks in its dtype, as autograd
    accumulates a weight used once per chunk)."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if need_h else None
    grad_weight = torch.zeros_like(weight) if need_weight else None
    need_grad = need_h or need_weight
    for rows, chunk_labels, chunk_grad_h in zip(
        h.tensor_split(num_chunks), labels.tensor_split(num_chunks),
        grad_h.tensor_split(num_chunks) if need_h else [None] * num_chunks,
    ):
        if rows.shape[0] == 0:
            continue
        chunk_loss, grad = kernel(rows @ weight.T, chunk_labels, softcap, need_grad)
        loss += chunk_loss
        if need_h:
            torch.mm(grad, weight, out=chunk_grad_h)
        if need_weight:
            grad_weight.addmm_(grad.T, rows)
        del grad
    return loss, grad_h, grad_weight


class _LinearCrossEntropySum(torch.autograd.Function):
    """:func:`_chunked_projection_loss` as an autograd function: the gradients it computes in forward are saved
    and, in backward, scaled by the incoming gradient of the loss."""

    @staticmethod
    def forward(ctx, h, weight, labels, num_chunks, softcap, kernel):
        loss, grad_h, grad_weight = _chunked_projection_loss(
            h, weight, labels, num_chunks=num_chunks, softcap=softcap, kernel=kernel,
            need_h=ctx.needs_input_grad[0], need_weight=ctx.needs_input_grad[1],
        )
        ctx.save_for_backward(grad_h, grad_weight)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        grad_h, grad_weight = ctx.saved_tensors
        # Scaled in place: this function's gradients are used once (a second backward through it is an error).
        grad_h = grad_h.mul_(grad_loss) if grad_h is not None else None
        grad_weight = grad_weight.mul_(grad_loss) if grad_weight is not None else None
        return grad_h, grad_weight, None, None, None, None


def linear_cross_entropy_sum(
    h: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_chunks: int = 8,
    softcap: float | None = None,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    kernel: LogitKernel = logit_loss_and_grad,
) -> torch.Tensor:
    """Summed float32 cross-entropy of the logits ``h @ weight.T`` (optionally soft-capped), never holding them.

    The non-ignored positions are projected ``num_chunks`` groups of rows at a time. For each group the logits,
    their float32 softmax and its gradient exist only while that group is processed; when gradients are wanted
    they are multiplied into the hidden states' and the weight's gradients right away. What outlives the forward
    pass is those two gradients (``[t, d]``, and ``[vocab, d]`` if the weight is trained), to be scaled in
    backward. The matmuls run in the autocast dtype when autocast is on (as ``F.linear`` would), else in the
    weight's dtype; the gradients come back in the inputs' dtypes.

    Finding the non-ignored positions reads the labels on the host (one device synchronization).

    Args:
        h: final hidden states ``[..., d]``.
        weight: the output projection ``[vocab, d]`` (a plain tensor: no bias, no adapter, no quantization).
        labels: ``h.shape[:-1]``, already shifted.
        num_chunks: groups the positions are processed in (more: less memory, smaller matmuls).
        softcap: Gemma 2's ``final_logit_softcap``.
        kernel: :func:`logit_loss_and_grad` or a compiled version of it.
    """
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be at least 1, got {num_chunks}")
    h, labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    kept = (labels != ignore_index).nonzero().squeeze(1)  # the one synchronization: its size is data
    if kept.numel() < labels.numel():  # no logits for prompt or padding positions
        h, labels = h.index_select(0, kept), labels.index_select(0, kept)
    device_type = h.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    with torch.autocast(device_type, enabled=False):
        h_c, weight_c = h.to(dtype), weight.to(dtype)
        if torch.is_grad_enabled() and (h_c.requires_grad or weight_c.requires_grad):
            return _LinearCrossEntropySum.apply(h_c, weight_c, labels, num_chunks, softcap, kernel)
        loss, _, _ = _chunked_projection_loss(
            h_c, weight_c, labels, num_chunks=num_chunks, softcap=softcap, kernel=kernel,
            need_h=False, need_weight=False,
        )
        return loss
