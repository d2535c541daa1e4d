"""Every way a model is spread over processes, in one place: the device mesh and its named dimensions
(:mod:`~toolkit.parallel.mesh`), data parallelism (:mod:`~toolkit.parallel.data_parallel`: DDP, ZeRO, HSDP) and
tensor parallelism (:mod:`~toolkit.parallel.tensor_parallel`) and expert parallelism
(:mod:`~toolkit.parallel.expert_parallel`), applied to a plain model from outside; and the process group under
them (:mod:`~toolkit.parallel.distributed`: ``init_distributed``, collectives every rank calls, rank-zero logging).

Nothing here imports :mod:`toolkit.training`; the training step's preparation (activation checkpointing, then
these transforms, then materializing the weights) is ``toolkit.training.parallelize``.
"""

from toolkit.parallel.data_parallel import (
    apply_data_parallel,
    apply_ddp,
    apply_fsdp,
    gradient_sync,
    is_zero_redundancy,
    shard_optimizer_state,
    unwrap,
)
from toolkit.parallel.distributed import (
    DistributedEnv,
    all_reduce_sum,
    barrier,
    destroy_distributed,
    init_distributed,
    on_rank_zero,
)
from toolkit.parallel.expert_parallel import apply_ep, check_expert_parallel
from toolkit.parallel.grad_norm import clip_grad_norm
from toolkit.parallel.mesh import MESH_DIMS, SHARDED_STRATEGIES, STRATEGIES, ParallelDims, parallel_dims
from toolkit.parallel.tensor_parallel import apply_tp, check_tensor_parallel

__all__ = [
    "DistributedEnv",
    "all_reduce_sum",
    "barrier",
    "destroy_distributed",
    "init_distributed",
    "on_rank_zero",
    "MESH_DIMS",
    "SHARDED_STRATEGIES",
    "STRATEGIES",
    "ParallelDims",
    "apply_data_parallel",
    "apply_ddp",
    "apply_ep",
    "apply_fsdp",
    "apply_tp",
    "check_expert_parallel",
    "check_tensor_parallel",
    "clip_grad_norm",
    "gradient_sync",
    "is_zero_redundancy",
    "parallel_dims",
    "shard_optimizer_state",
    "unwrap",
]
