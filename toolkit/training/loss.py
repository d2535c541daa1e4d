"""Loss normalization that does not depend on how the global batch is split.

The loss of an optimizer step is the mean over every non-ignored token of the global batch: the sum of token
losses over all micro-batches and ranks divided by the global token count. A mean of per-micro-batch (or
per-rank) means weights tokens of short sequences more and changes with the number of GPUs and accumulation
steps (the HF Trainer's 2024 gradient-accumulation bug). We count the global tokens before the backward passes,
so each micro-batch contributes ``sum / N_global`` and the accumulated gradient is exact.
"""

import torch
import torch.nn.functional as F

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.training.distributed import all_reduce_sum

def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies, in float32, over the non-ignored positions.

    Args:
        logits: ``[b, s, vocab]``.
        labels: ``[b, s]``, already shifted (``labels[:, i]`` is the target at position ``i``).
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )


def global_token_count(label_batches: list[torch.Tensor], *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX) -> int:
    """Non-ignored tokens in this rank's micro-batches, summed over all ranks (one small all-reduce)."""
    local = sum(int((labels != ignore_index).sum()) for labels in label_batches)
    return int(all_reduce_sum(torch.tensor([local], dtype=torch.float64, device=label_batches[0].device)).item())


def gradient_scale(*, global_tokens: int, data_parallel_size: int) -> float:
    """The factor turning a micro-batch's loss sum into its share of the global mean.

    Data-parallel gradient reduction averages over ranks (DDP all-reduce, FSDP reduce-scatter), i.e. divides by
    the data-parallel size; multiplying by it here cancels that, leaving ``sum / N_global``.
    """
    return data_parallel_size / max(global_tokens, 1)
