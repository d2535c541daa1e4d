"""Optimizers and learning-rate schedules: the optimizer a config names (:func:`build_optimizer`), the parameter
groups it gets and the step run inside backward (:mod:`~toolkit.optim.optimizers`), Muon
(:mod:`~toolkit.optim.muon`) and the schedules (:mod:`~toolkit.optim.lr_schedulers`). torchao's 8-bit and 4-bit
AdamW are named by their own ``_component_``."""

from toolkit.optim.lr_schedulers import cosine_with_warmup
from toolkit.optim.muon import Muon
from toolkit.optim.optimizers import (
    OptimizerInBackward,
    build_optimizer,
    check_optimizer_in_backward,
    fused_by_default,
    optimizer_parameters,
)

__all__ = [
    "Muon",
    "OptimizerInBackward",
    "build_optimizer",
    "check_optimizer_in_backward",
    "cosine_with_warmup",
    "fused_by_default",
    "optimizer_parameters",
]
