"""Learning-rate schedules."""

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def cosine_with_warmup(
    optimizer: Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0
) -> LambdaLR:
    """Linear warmup from 0 to the base learning rate, then a cosine decay to ``min_lr_ratio`` of it.

    Args:
        optimizer: the optimizer whose learning rates are scheduled.
        warmup_steps: optimizer steps of linear warmup.
        total_steps: optimizer steps in the whole run (the decay ends there).
        min_lr_ratio: the final learning rate as a fraction of the base.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
