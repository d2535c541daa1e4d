"""The training step: accumulation and loss scaling, mixed precision, activation checkpointing and offloading,
compile and float8, parallelizing a built model in the step's order, the step itself, validation and metrics.

The other rooms a recipe uses are beside it: :mod:`toolkit.parallel` (processes, the mesh and every dimension),
:mod:`toolkit.optim`, :mod:`toolkit.planning`, :mod:`toolkit.checkpoint` and :mod:`toolkit.objectives`. Their public
names were importable from here before they got rooms of their own, and a recipe copied then still imports them
from here: :data:`MOVED` says where each one lives now, and it is imported from there on first use (lazily, so that
importing a training module never imports the rooms above it).
"""

import importlib

from toolkit.training.accumulation import global_token_count, gradient_accumulation_steps, gradient_scale
from toolkit.training.activations import ActivationOffloader, apply_activation_checkpointing, apply_activation_offloading
from toolkit.training.attention_backend import batch_attention_mask, resolve_flex_attention, sdpa_preference
from toolkit.training.compile import compile_model, static_lengths
from toolkit.training.debug import breakpoint_on_rank, inject_fault
from toolkit.training.float8 import FLOAT8_TOKEN_MULTIPLE, apply_float8, check_float8_device
from toolkit.training.init import init_weights, materialize, set_seed
from toolkit.training.metrics import MetricsLogger, peak_memory_gib, rank_stats, step_metrics
from toolkit.training.parallelize import parallelize
from toolkit.training.precision import PrecisionPolicy, precision_policy
from toolkit.training.profiling import StepProfiler, flops_per_token, measure_peak_flops, profiler_settings
from toolkit.training.step import StepResult, forward_backward, global_batches, make_grad_scaler, optimizer_step
from toolkit.training.validation import ValidationSampler, validation_loss

# A name that moved to another room -> that room (one line each).
MOVED = {
    "HFCheckpointer": "toolkit.checkpoint",
    "MetaCheckpointer": "toolkit.checkpoint",
    "StepCheckpointer": "toolkit.checkpoint",
    "TrainingState": "toolkit.checkpoint",
    "claim_output_dir": "toolkit.checkpoint",
    "find_resume_checkpoint": "toolkit.checkpoint",
    "gather_full_state_dict": "toolkit.checkpoint",
    "latest_checkpoint": "toolkit.checkpoint",
    "load_model_family": "toolkit.checkpoint",
    "prepare_output_dir": "toolkit.checkpoint",
    "start_run": "toolkit.checkpoint",
    "chunked_cross_entropy_sum": "toolkit.modules.loss",
    "cross_entropy_sum": "toolkit.modules.loss",
    "Muon": "toolkit.optim",
    "OptimizerInBackward": "toolkit.optim",
    "check_optimizer_in_backward": "toolkit.optim",
    "cosine_with_warmup": "toolkit.optim",
    "fused_by_default": "toolkit.optim",
    "optimizer_parameters": "toolkit.optim",
    "DistributedEnv": "toolkit.parallel",
    "ParallelDims": "toolkit.parallel",
    "STRATEGIES": "toolkit.parallel",
    "all_reduce_sum": "toolkit.parallel",
    "apply_data_parallel": "toolkit.parallel",
    "apply_ddp": "toolkit.parallel",
    "apply_fsdp": "toolkit.parallel",
    "barrier": "toolkit.parallel",
    "clip_grad_norm": "toolkit.parallel",
    "destroy_distributed": "toolkit.parallel",
    "gradient_sync": "toolkit.parallel",
    "init_distributed": "toolkit.parallel",
    "on_rank_zero": "toolkit.parallel",
    "parallel_dims": "toolkit.parallel",
    "shard_optimizer_state": "toolkit.parallel",
    "unwrap": "toolkit.parallel",
    "ParallelPlan": "toolkit.planning",
    "StepKernels": "toolkit.planning",
    "choose_layout": "toolkit.planning",
    "choose_strategy": "toolkit.planning",
    "estimate_memory": "toolkit.planning",
    "optimizer_memory_model": "toolkit.planning",
    "plan_parallelism": "toolkit.planning",
}


def current_path(dotted: str) -> str:
    """A ``_component_`` path as it is named today: ``toolkit.training.HFCheckpointer``, as configs (and the step
    checkpoints' ``config.yaml``) written before the move name it, is ``toolkit.checkpoint.HFCheckpointer``; any
    other path is itself."""
    package, _, name = dotted.rpartition(".")
    return f"{MOVED[name]}.{name}" if package == __name__ and name in MOVED else dotted


def __getattr__(name: str) -> object:
    if name in MOVED:
        return getattr(importlib.import_module(MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ActivationOffloader",
    "DistributedEnv",
    "FLOAT8_TOKEN_MULTIPLE",
    "HFCheckpointer",
    "MetaCheckpointer",
    "MetricsLogger",
    "Muon",
    "OptimizerInBackward",
    "ParallelDims",
    "ParallelPlan",
    "PrecisionPolicy",
    "STRATEGIES",
    "StepCheckpointer",
    "StepKernels",
    "StepProfiler",
    "StepResult",
    "TrainingState",
    "ValidationSampler",
    "all_reduce_sum",
    "apply_activation_checkpointing",
    "apply_activation_offloading",
    "apply_data_parallel",
    "apply_ddp",
    "apply_float8",
    "apply_fsdp",
    "barrier",
    "batch_attention_mask",
    "breakpoint_on_rank",
    "check_float8_device",
    "check_optimizer_in_backward",
    "choose_layout",
    "choose_strategy",
    "chunked_cross_entropy_sum",
    "claim_output_dir",
    "clip_grad_norm",
    "compile_model",
    "cosine_with_warmup",
    "cross_entropy_sum",
    "destroy_distributed",
    "estimate_memory",
    "find_resume_checkpoint",
    "flops_per_token",
    "forward_backward",
    "fused_by_default",
    "gather_full_state_dict",
    "global_batches",
    "global_token_count",
    "gradient_accumulation_steps",
    "gradient_scale",
    "gradient_sync",
    "init_distributed",
    "init_weights",
    "inject_fault",
    "latest_checkpoint",
    "load_model_family",
    "make_grad_scaler",
    "materialize",
    "measure_peak_flops",
    "on_rank_zero",
    "optimizer_memory_model",
    "optimizer_parameters",
    "optimizer_step",
    "parallel_dims",
    "parallelize",
    "peak_memory_gib",
    "plan_parallelism",
    "precision_policy",
    "prepare_output_dir",
    "profiler_settings",
    "rank_stats",
    "resolve_flex_attention",
    "sdpa_preference",
    "set_seed",
    "shard_optimizer_state",
    "start_run",
    "static_lengths",
    "step_metrics",
    "unwrap",
    "validation_loss",
]
