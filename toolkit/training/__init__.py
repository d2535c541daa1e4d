"""Training mechanics shared by every recipe: distributed setup, loss normalization, precision, schedules,
checkpoints and metrics (and, re-exported, the parallel transforms of :mod:`toolkit.parallel`)."""

from toolkit.training.accumulation import gradient_accumulation_steps
from toolkit.training.activations import (
    ActivationOffloader,
    apply_activation_checkpointing,
    apply_activation_offloading,
)
from toolkit.training.attention import batch_attention_mask, resolve_flex_attention, sdpa_preference
from toolkit.training.checkpointing import (
    HFCheckpointer,
    gather_full_state_dict,
    load_model_family,
)
from toolkit.training.debug import breakpoint_on_rank, inject_fault
from toolkit.training.distributed import (
    DistributedEnv,
    all_reduce_sum,
    barrier,
    destroy_distributed,
    init_distributed,
    on_rank_zero,
)
from toolkit.training.float8 import FLOAT8_TOKEN_MULTIPLE, apply_float8, check_float8_device
from toolkit.training.init import init_weights, materialize, set_seed
from toolkit.training.compile import compile_model, static_lengths
from toolkit.training.loss import chunked_cross_entropy_sum, cross_entropy_sum, global_token_count, gradient_scale
from toolkit.training.lr_schedulers import cosine_with_warmup
from toolkit.training.memory import StepKernels, estimate_memory, optimizer_memory_model
from toolkit.training.meta_checkpoint import MetaCheckpointer
from toolkit.training.metrics import MetricsLogger, peak_memory_gib, rank_stats, step_metrics
from toolkit.training.muon import Muon
from toolkit.training.optim import OptimizerInBackward, check_optimizer_in_backward, fused_by_default, optimizer_parameters
# The parallel transforms live in toolkit.parallel; re-exported here, where recipes copied earlier import them.
from toolkit.parallel import (
    STRATEGIES,
    ParallelDims,
    apply_data_parallel,
    apply_ddp,
    apply_fsdp,
    clip_grad_norm,
    gradient_sync,
    parallel_dims,
    shard_optimizer_state,
    unwrap,
)
from toolkit.training.output_dir import claim_output_dir, prepare_output_dir, start_run
from toolkit.training.parallelize import parallelize
from toolkit.training.planning import ParallelPlan, choose_layout, choose_strategy, plan_parallelism
from toolkit.training.precision import PrecisionPolicy, precision_policy
from toolkit.training.profiling import StepProfiler, flops_per_token, measure_peak_flops, profiler_settings
from toolkit.training.step_checkpoint import (
    StepCheckpointer,
    TrainingState,
    find_resume_checkpoint,
    latest_checkpoint,
)
from toolkit.training.step import StepResult, forward_backward, global_batches, make_grad_scaler, optimizer_step
from toolkit.training.validation import ValidationSampler, validation_loss

__all__ = [
    "FLOAT8_TOKEN_MULTIPLE",
    "ActivationOffloader",
    "DistributedEnv",
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
    "claim_output_dir",
    "choose_layout",
    "choose_strategy",
    "chunked_cross_entropy_sum",
    "clip_grad_norm",
    "compile_model",
    "static_lengths",
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
    "profiler_settings",
    "prepare_output_dir",
    "rank_stats",
    "resolve_flex_attention",
    "sdpa_preference",
    "set_seed",
    "shard_optimizer_state",
    "start_run",
    "step_metrics",
    "unwrap",
    "validation_loss",
]
