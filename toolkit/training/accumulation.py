"""Gradient accumulation derived from the global batch."""

from toolkit.errors import UserError


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
