"""Loss normalization that does not depend on how the global batch is split.

The loss of an optimizer step is the mean over every non-ignored token of the global batch: the sum of token
losses over all micro-batches and ranks divided by the global token count. A mean of per-micro-batch (or
per-rank) means weights tokens of short sequences more and changes with the number of GPUs and accumulation
steps (the HF Trainer's 2024 gradient-accumulation bug). We count the global tokens before the backward passes,
so each micro-batch contributes ``sum / N_global`` and the accumulated gradient is exact.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
# The token loss sums themselves are model building blocks; they are imported here, where they were first defined.
from toolkit.modules.loss import chunked_cross_entropy_sum, cross_entropy_sum, linear_cross_entropy_sum

__all__ = [
    "chunked_cross_entropy_sum",
    "cross_entropy_sum",
    "global_token_count",
    "gradient_scale",
    "linear_cross_entropy_sum",
    "start_global_token_count",
]


def global_token_count(
    label_batches: list[torch.Tensor],
    *,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    group: dist.ProcessGroup | None = None,
) -> int:
    """Non-ignored tokens in this rank's micro-batches, summed over the data-parallel ranks ``group`` (default: all
    ranks; one small all-reduce)."""
    return start_global_token_count(label_batches, ignore_index=ignore_index, group=group)()


def start_global_token_count(
    label_batches: list[torch.Tensor],
    *,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    group: dist.ProcessGroup | None = None,
) -> Callable[[], int]:
    """Start :func:`global_token_count`'s all-reduce and return a function that waits for it and gives the count.

    The count is needed only before the first backward, so the first forward runs while it travels: a rank that
    arrives first does not sit idle waiting for the slower one (on CPU, two cores shared by two ranks, this wait
    is most of what data parallelism costs when the gradients are small, as LoRA's are).

    Under tensor parallelism the ``tp`` ranks of a group read the same micro-batches: ``group`` must then be the
    data-parallel ranks (``ParallelDims.dp_group``), or each token would be counted ``tp`` times.
    """
    local = sum(int((labels != ignore_index).sum()) for labels in label_batches)
    if not dist.is_initialized():
        return lambda: local
    total = torch.tensor([local], dtype=torch.float64)  # a CPU tensor: gloo's half of the process group carries it
    work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group, async_op=True)

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
