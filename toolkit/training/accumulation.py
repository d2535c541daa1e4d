"""How micro-batches and ranks add up to one optimizer step over the global batch.

The accumulation steps follow from the global batch, the micro-batch and the data-parallel size. The loss of an
optimizer step is the mean over every non-ignored token of the global batch: the sum of token losses over all
micro-batches and ranks divided by the global token count. A mean of per-micro-batch (or per-rank) means weights
tokens of short sequences more and changes with the number of GPUs and accumulation steps (the HF Trainer's 2024
gradient-accumulation bug). We count the global tokens before the backward passes, so each micro-batch contributes
``sum / N_global`` and the accumulated gradient is exact.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist

from toolkit.errors import UserError
from toolkit.modules.masks import CROSS_ENTROPY_IGNORE_INDEX


def gradient_accumulation_steps(*, batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that ``micro_batch_size x world_size x steps == batch_size``.

    Args:
        batch_size: global sequences per optimizer step, all ranks and micro-steps together.
        micro_batch_size: sequences per device per forward/backward.
        world_size: data-parallel processes.

    Raises:
        UserError: the sizes do not divide; the message suggests the nearest sizes that do.
    """
    for name, value in (("batch_size", batch_size), ("micro_batch_size", micro_batch_size)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name}: must be a positive integer, got {value!r}")
    per_step = micro_batch_size * world_size
    if per_step > batch_size and batch_size % world_size:
        # A micro batch above a process's share is cut to it (micro_batch_within_share): only the processes count.
        lower = max(world_size, batch_size // world_size * world_size)
        raise UserError(
            f"batch_size: {batch_size} is not divisible by the world size ({world_size}); "
            f"use batch_size={lower} or {lower + world_size}"
        )
    if batch_size % per_step:
        lower = max(per_step, batch_size // per_step * per_step)
        raise UserError(
            f"batch_size: {batch_size} is not divisible by micro_batch_size ({micro_batch_size}) x "
            f"world size ({world_size}) = {per_step}; use batch_size={lower} or {lower + per_step}, "
            "or change micro_batch_size"
        )
    return batch_size // per_step


def micro_batch_within_share(*, batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """The micro batch a run takes: ``micro_batch_size``, or each process's share of ``batch_size`` when that is
    smaller.

    A micro batch cannot hold more sequences than a process gets per step, so a config sized for fewer processes
    (the demo's 16 of 32 on 2) runs on 4 or 8 with the same global batch, and so the same training, instead of
    stopping on sizes that do not divide. Sizes that do not divide otherwise are returned as given, for
    :func:`gradient_accumulation_steps` to refuse.
    """
    if isinstance(micro_batch_size, int) and isinstance(batch_size, int) and batch_size > 0 and world_size > 0:
        if batch_size % world_size == 0:
            return min(micro_batch_size, batch_size // world_size)
    return micro_batch_size


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
