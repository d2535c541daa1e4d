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
    if batch_size % per_step:
        lower = max(per_step, batch_size // per_step * per_step)
        raise UserError(
            f"batch_size: {batch_size} is not divisible by micro_batch_size ({micro_batch_size}) x "
            f"world size ({world_size}) = {per_step}; use batch_size={lower} or {lower + per_step}, "
            "or change micro_batch_size"
        )
    return batch_size // per_step
