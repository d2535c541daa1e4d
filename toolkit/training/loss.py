"""Loss normalization that does not depend on how the global batch is split.

The loss of an optimizer step is the mean over every non-ignored token of the global batch: the sum of token
losses over all micro-batches and ranks divided by the global token count. A mean of per-micro-batch (or
per-rank) means weights tokens of short sequences more and changes with the number of GPUs and accumulation
steps (the HF Trainer's 2024 gradient-accumulation bug). We count the global tokens before the backward passes,
so each micro-batch contributes ``sum / N_global`` and the accumulated gradient is exact.
"""

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
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
        labels = labels.reshape(-1, 1)  # [b * s_i, 1]
        kept = labels != ctx.ignore_index
        grad = torch.softmax(logits.reshape(-1, logits.shape[-1]), dim=-1, dtype=torch.float32)
        # Ignored positions scatter 0 into column 0 (their label is not an index), then are zeroed by `kept`.
        grad.scatter_add_(1, torch.where(kept, labels, 0), -kept.to(grad.dtype))
        grad.mul_(kept * grad_loss)
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


def global_token_count(label_batches: list[torch.Tensor], *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> int:
    """Non-ignored tokens in this rank's micro-batches, summed over all ranks (one small all-reduce)."""
    return start_global_token_count(label_batches, ignore_index=ignore_index)()


def start_global_token_count(
    label_batches: list[torch.Tensor], *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX
) -> Callable[[], int]:
    """Start :func:`global_token_count`'s all-reduce and return a function that waits for it and gives the count.

    The count is needed only before the first backward, so the first forward runs while it travels: a rank that
    arrives first does not sit idle waiting for the slower one (on CPU, two cores shared by two ranks, this wait
    is most of what data parallelism costs when the gradients are small, as LoRA's are).
    """
    local = sum(int((labels != ignore_index).sum()) for labels in label_batches)
    if not dist.is_initialized():
        return lambda: local
    total = torch.tensor([local], dtype=torch.float64)  # a CPU tensor: gloo's half of the process group carries it
    work = dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True)

    def wait() -> int:
        work.wait()
        return int(total.item())

    return wait


def gradient_scale(*, global_tokens: int, data_parallel_size: int) -> float:
    """The factor turning a micro-batch's loss sum into its share of the global mean.

    Data-parallel gradient reduction averages over ranks (DDP all-reduce, FSDP reduce-scatter), i.e. divides by
    the data-parallel size; multiplying by it here cancels that, leaving ``sum / N_global``.
    """
    return data_parallel_size / max(global_tokens, 1)
