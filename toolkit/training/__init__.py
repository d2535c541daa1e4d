"""Training mechanics shared by every recipe: distributed setup, data parallelism, loss normalization,
precision, schedules, checkpoints and metrics."""

from toolkit.training.accumulation import gradient_accumulation_steps
from toolkit.training.checkpointing import HFCheckpointer, load_model_family, prepare_output_dir
from toolkit.training.distributed import (
    DistributedEnv,
    all_reduce_sum,
    barrier,
    destroy_distributed,
    init_distributed,
    on_rank_zero,
)
from toolkit.training.init import init_weights, materialize, set_seed
from toolkit.training.loss import IGNORE_INDEX, cross_entropy_sum, global_token_count, gradient_scale
from toolkit.training.lr_schedulers import cosine_with_warmup
from toolkit.training.metrics import MetricsLogger, print_rank_zero
from toolkit.training.parallel import apply_ddp, gradient_sync, unwrap
from toolkit.training.precision import param_dtype

__all__ = [
    "IGNORE_INDEX",
    "DistributedEnv",
    "HFCheckpointer",
    "MetricsLogger",
    "all_reduce_sum",
    "apply_ddp",
    "barrier",
    "cosine_with_warmup",
    "cross_entropy_sum",
    "destroy_distributed",
    "global_token_count",
    "gradient_accumulation_steps",
    "gradient_scale",
    "gradient_sync",
    "init_distributed",
    "init_weights",
    "load_model_family",
    "materialize",
    "on_rank_zero",
    "param_dtype",
    "prepare_output_dir",
    "print_rank_zero",
    "set_seed",
    "unwrap",
]
