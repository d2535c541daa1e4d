"""What a training step holds in memory (:mod:`~toolkit.planning.memory`, with the activations of
:mod:`~toolkit.planning.activation_memory`) and the layout chosen from it (:mod:`~toolkit.planning.layout`:
the data-parallel strategy, the tensor, context and expert degrees, and the micro-batch), for ``tune plan`` and
for the recipes' ``auto`` settings."""

from toolkit.planning.layout import ParallelPlan, choose_layout, choose_strategy, plan_parallelism
from toolkit.planning.memory import StepKernels, estimate_memory, optimizer_memory_model

__all__ = [
    "ParallelPlan",
    "StepKernels",
    "choose_layout",
    "choose_strategy",
    "estimate_memory",
    "optimizer_memory_model",
    "plan_parallelism",
]
