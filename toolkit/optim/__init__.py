"""Optimizers and learning-rate schedules: the parameter groups a config's optimizer gets and the step run inside
backward (:mod:`~toolkit.optim.optimizers`), Muon (:mod:`~toolkit.optim.muon`) and the schedules
(:mod:`~toolkit.optim.lr_schedulers`). torchao's 8-bit and 4-bit AdamW are named by their own ``_component_``."""

from toolkit.optim.lr_schedulers import cosine_with_warmup
from toolkit.optim.muon import Muon
from toolkit.optim.optimizers import (
    OptimizerInBackward,
    check_optimizer_in_backward,
    fused_by_default,
    optimizer_parameters,
)

__all__ = [
    "Muon",
    "OptimizerInBackward",
    "check_optimizer_in_backward",
    "cosine_with_warmup",
    "fused_by_default",
    "optimizer_parameters",
]
