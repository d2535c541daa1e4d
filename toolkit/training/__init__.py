"""The training step: accumulation and loss scaling, mixed precision, activation checkpointing and offloading,
compile and float8, parallelizing a built model in the step's order, the step itself, validation and metrics.

The other rooms a recipe uses are beside it: :mod:`toolkit.parallel` (processes, the mesh and every dimension),
:mod:`toolkit.optim`, :mod:`toolkit.planning`, :mod:`toolkit.checkpoint` and :mod:`toolkit.objectives`. Their public
names were importable from here before they got rooms of their own, and a recipe copied then still imports them
from here: :data:`~toolkit.config.moved.MOVED` says where each one lives now, and it is imported from there on first use (lazily, so that
importing a training module never imports the rooms above it).
"""

import importlib

from toolkit.config.moved import MOVED

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
