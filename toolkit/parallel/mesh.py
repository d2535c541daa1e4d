"""The parallel layout of a job: one device mesh whose named dimensions multiply to the world size.

``dp_replicate x dp_shard x tp`` ranks, tensor parallelism innermost (the ranks of one TP group are consecutive,
so with ``tp`` up to the GPUs of a node its all-reduces stay on the node's fast links). Expert parallelism is
carved out of the data-parallel ranks: with ``ep`` > 1, ``dp_shard`` is laid out as ``dp_shard_mod_ep x ep``
(flattened back into ``dp_shard`` for everything but the experts: :meth:`ParallelDims.fsdp_mesh`), each group of ``ep`` consecutive ranks
sharing out the experts (:mod:`toolkit.parallel.expert_parallel`). Context parallelism (``cp``) groups ``cp``
consecutive data-parallel ranks that share their samples, each holding part of every sequence
(:mod:`toolkit.parallel.context_parallel`): to FSDP2 and DDP they are data-parallel ranks like any other (each
holds the gradient of its positions' share of the loss), so the strategies below span them; their ring and
all-to-all run on the ``cp`` dimension of a second mesh over the same ranks, ``(batch, cp, tp)``
(:meth:`ParallelDims.context_parallel`). Everything that counts tokens (the loss normalization, the metrics) asks
for ``dp_size`` and ``dp_rank``; what counts samples (the sampler, the global batch) for ``batch_ranks`` and
``batch_rank``, the same without context parallelism; nothing else needs the world size.

| strategy | parameters            | gradients | optimizer state | built on                                  |
|----------|-----------------------|-----------|-----------------|-------------------------------------------|
| ddp      | replicated            | replicated| replicated      | DistributedDataParallel (FSDP2 under TP)  |
| zero1    | replicated            | replicated| sharded         | DDP + ZeroRedundancyOptimizer             |
| zero2    | sharded, kept gathered from forward to backward | sharded | sharded | FSDP2, reshard_after_forward=False |
| zero3    | sharded               | sharded   | sharded         | FSDP2, reshard_after_forward=True         |
| hsdp     | sharded within a group of ``dp_shard`` ranks, replicated across groups | | | FSDP2 on a 2-D mesh |

Every strategy spans the data-parallel ranks (world size / ``tp``); tensor parallelism splits each layer over
the ``tp`` ranks of a group (:mod:`toolkit.parallel.tensor_parallel`). Under TP, ``ddp`` runs as FSDP2 with a
shard group of one (replicating over ``dp_replicate``): DistributedDataParallel takes no DTensor parameters.
"""

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from toolkit.errors import UserError

if TYPE_CHECKING:
    from toolkit.parallel.context_parallel import ContextParallel

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
SHARDED_STRATEGIES = ("zero2", "zero3", "hsdp")
# The mesh's dimensions, outermost first (with expert parallelism, EXPERT_MESH_DIMS).
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
EXPERT_MESH_DIMS = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
# The data-parallel strategies expert parallelism combines with: FSDP2 shards the other parameters over every
# data-parallel rank, and the experts over the ranks that hold the same ones.
EXPERT_PARALLEL_STRATEGIES = ("zero2", "zero3")


@dataclass(frozen=True)
class ParallelDims:
    """The layout: ``world_size = dp_replicate x dp_shard x tp``.

    Attributes:
        strategy: one of :data:`STRATEGIES`, over the data-parallel ranks.
        dp_replicate: data-parallel groups holding a full replica of the (tensor-parallel) model.
        dp_shard: data-parallel ranks a parameter is sharded over (1 for ddp/zero1; every data-parallel rank for
            zero2/zero3; the shard group for hsdp).
        tp: ranks each layer is split over (tensor parallelism).
        cpu_offload: sharded parameters, gradients and optimizer state live in host memory.
        rank: this process's global rank.
        ep: data-parallel ranks the experts of a mixture-of-experts layer are shared out over (expert
            parallelism; a divisor of ``dp_shard``).
        cp: consecutive data-parallel ranks each sequence is split over (context parallelism; a divisor of
            ``dp_size``).
    """

    strategy: str
    dp_replicate: int
    dp_shard: int
    tp: int = 1
    cpu_offload: bool = False
    rank: int = 0
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own share of every global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank; the ``tp`` ranks of a group share it (and read the same data)."""
        return self.rank // self.tp

    @property
    def batch_ranks(self) -> int:
        """Ranks that read distinct samples: the data-parallel ranks over ``cp`` (the ranks of a CP group read the
        same ones). The sampler and the global batch's split into micro-batches count these."""
        return self.dp_size // self.cp

    @property
    def batch_rank(self) -> int:
        """This rank's index among :attr:`batch_ranks`."""
        return self.dp_rank // self.cp

    @property
    def is_sharded(self) -> bool:
        """Whether FSDP2 shards the model (never for one data-parallel rank: it is then left unsharded)."""
        return self.strategy in SHARDED_STRATEGIES and self.dp_size > 1

    @property
    def uses_fsdp(self) -> bool:
        """Whether FSDP2 reduces the gradients: the sharded strategies, and ``ddp`` over tensor-parallel groups
        (DistributedDataParallel takes no DTensor parameters; FSDP2 with a shard group of one replicates)."""
        return self.is_sharded or (self.tp > 1 and self.dp_size > 1)

    def row_multiple(self, *, sequence_parallel: bool, part_multiple: int = 1) -> int:
        """What every batch's row length is padded to a multiple of: the parts it is cut into (the TP degree under
        sequence parallelism, each rank then holding its part; ``2 x cp`` chunks under context parallelism), each
        a multiple of ``part_multiple`` long (16 for float8's matmuls, whose weight gradients contract over the
        tokens: :data:`toolkit.training.FLOAT8_TOKEN_MULTIPLE`)."""
        parts = math.lcm(self.tp if sequence_parallel else 1, 2 * self.cp if self.cp > 1 else 1)
        return parts * part_multiple

    @property
    def label(self) -> str:
        """The layout in a few words, for the run's summary line: ``zero3``, ``zero3 x tensor_parallel 2``."""
        parts = [self.strategy]
        if self.ep > 1:
            parts.append(f"expert_parallel {self.ep}")
        if self.cp > 1:
            parts.append(f"context_parallel {self.cp}")
        if self.tp > 1:
            parts.append(f"tensor_parallel {self.tp}")
        return " x ".join(parts)

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The job's one device mesh, dimensions :data:`MESH_DIMS` (None for one process); with expert
        parallelism :data:`EXPERT_MESH_DIMS`. A collective."""
        if self.world_size == 1:
            return None
        if self.ep == 1:
            return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp), mesh_dim_names=MESH_DIMS)
        shape = (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)

    def context_parallel(self, device_type: str, method: str) -> "ContextParallel | None":
        """This rank's context-parallel group, attending by ``method`` (None without context parallelism): the
        ``cp`` dimension of the mesh ``(batch, cp, tp)`` over every rank. A collective."""
        if self.cp == 1:
            return None
        from toolkit.parallel.context_parallel import ContextParallel

        shape = (self.world_size // (self.cp * self.tp), self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=("batch", "cp", "tp"))
        return ContextParallel(mesh["cp"].get_group(), self.cp, self.dp_rank % self.cp, method)

    def expert_fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """What FSDP2 shards a layer's experts over under expert parallelism: the ranks holding the same experts
        (one per group of ``ep``), ``dp_shard_mod_ep``."""
        return mesh["dp_shard_mod_ep"]

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The data-parallel submesh FSDP2 shards over: 1-D ``dp_shard`` for ZeRO-2/3, 2-D
        ``(dp_replicate, dp_shard)`` for HSDP and for ``ddp`` under tensor parallelism (a shard group of one)."""
        if self.ep > 1:  # dp_shard is dp_shard_mod_ep x ep, flattened (cached by the mesh after the first call)
            # DeviceMesh has no public flatten; _flatten is how torchtitan makes the same dimension.
            return mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        if self.strategy in ("zero2", "zero3"):
            return mesh["dp_shard"]
        return mesh["dp_replicate", "dp_shard"]

    def dp_group(self, mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
        """The process group of this rank's data-parallel peers (the ranks at its TP position), over which the
        token count and the logged loss are summed; None where that is every rank (no TP, or no mesh)."""
        if mesh is None or self.tp == 1:
            return None
        if self.dp_replicate == 1:
            return mesh["dp_shard"].get_group()
        if self.dp_shard == 1:
            return mesh["dp_replicate"].get_group()
        # DeviceMesh has no public flatten; _flatten is how torchtitan makes the same group.
        return mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()


# FSDP2 offloads the shards of a model sharded over several processes; one process's model is left unwrapped
# (apply_data_parallel), so cpu_offload there would be silently ignored while the memory plan counted it.
ONE_PROCESS_OFFLOAD = (
    "cpu_offload: offloads the shards of a model sharded over 2 or more processes, and one process has none; remove "
    "cpu_offload, or on one GPU save memory with optimizer_in_backward=true, activation_offloading=true or LoRA"
)


def parallel_dims(
    *,
    strategy: str,
    world_size: int,
    local_world_size: int,
    shard_size: int | None = None,
    cpu_offload: bool = False,
    device_type: str = "cuda",
    tensor_parallel: int = 1,
    rank: int = 0,
    expert_parallel: int = 1,
    context_parallel: int = 1,
) -> ParallelDims:
    """Check a layout against the job's shape and return it.

    Args:
        strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``hsdp`` (``auto`` is resolved before this), over
            the data-parallel ranks.
        world_size: all ranks.
        local_world_size: ranks per node; HSDP shards within a node by default.
        shard_size: HSDP's shard group size, in data-parallel ranks (default: the data-parallel ranks of a node).
        cpu_offload: offload sharded state to host memory (sharded strategies only).
        device_type: ``cuda`` or ``cpu``; offloading needs an accelerator to offload from.
        tensor_parallel: ranks each layer is split over (config ``tensor_parallel``).
        rank: this process's global rank.
        expert_parallel: data-parallel ranks the experts are shared out over (config ``expert_parallel``).
        context_parallel: data-parallel ranks each sequence is split over (config ``context_parallel``).

    Raises:
        UserError: an unknown strategy, ``cpu_offload`` without sharding, a GPU or a second process, a shape that
            does not divide, or a strategy tensor parallelism cannot combine with.
    """
    if strategy not in STRATEGIES:
        raise UserError(f"data_parallel: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or auto")
    if cpu_offload and strategy not in SHARDED_STRATEGIES:
        raise UserError(
            f"cpu_offload: needs a sharded strategy ({', '.join(SHARDED_STRATEGIES)}), not data_parallel={strategy}"
        )
    if cpu_offload and device_type == "cpu":
        raise UserError("cpu_offload: training already runs on the CPU (no GPU found); remove cpu_offload")
    if cpu_offload and world_size == 1:
        raise UserError(ONE_PROCESS_OFFLOAD)
    for problem in tensor_parallel_problems(
        tensor_parallel=tensor_parallel, world_size=world_size, strategy=strategy, cpu_offload=cpu_offload
    ):
        raise UserError(": ".join(problem))
    for problem in expert_parallel_problems(
        expert_parallel=expert_parallel, world_size=world_size, strategy=strategy, tensor_parallel=tensor_parallel,
        cpu_offload=cpu_offload,
    ):
        raise UserError(": ".join(problem))
    for problem in context_parallel_layout_problems(
        context_parallel=context_parallel, data_parallel_size=world_size // tensor_parallel,
        expert_parallel=expert_parallel,
    ):
        raise UserError(": ".join(problem))
    dp_size = world_size // tensor_parallel
    if strategy == "hsdp":
        shard = shard_size or max(1, local_world_size // tensor_parallel)
        if shard < 1 or dp_size % shard:
            raise UserError(
                f"hsdp_shard_size: {dp_size} data-parallel ranks cannot be split into shard groups of {shard}; "
                f"choose a divisor of {dp_size}"
            )
        return ParallelDims(strategy, dp_size // shard, shard, tensor_parallel, cpu_offload, rank,
                            cp=context_parallel)
    shard = dp_size if strategy in ("zero2", "zero3") else 1
    return ParallelDims(strategy, dp_size // shard, shard, tensor_parallel, cpu_offload, rank, expert_parallel,
                        context_parallel)


def context_parallel_layout_problems(
    *, context_parallel: int, data_parallel_size: int | None, expert_parallel: int = 1,
) -> list[tuple[str, str]]:
    """``(key, problem)`` for a context-parallel degree that does not divide the data-parallel ranks (world size
    over ``tensor_parallel``) or meets expert parallelism (the schema's rule and :func:`parallel_dims` say the
    same)."""
    if context_parallel == 1:
        return []
    problems = []
    if data_parallel_size is not None and data_parallel_size % context_parallel:
        problems.append((
            "context_parallel", f"{context_parallel} does not divide the {data_parallel_size} data-parallel "
            "processes (the launch's processes over tensor_parallel); choose a divisor of "
            f"{data_parallel_size}, or launch a multiple of {context_parallel}",
        ))
    if expert_parallel != 1:
        problems.append((
            "expert_parallel", f"cannot combine with context_parallel={context_parallel} yet; use one of them",
        ))
    return problems


def expert_parallel_problems(
    *, expert_parallel: int, world_size: int | None, strategy: str | None, tensor_parallel: int | str | None = 1,
    cpu_offload: bool = False,
) -> list[tuple[str, str]]:
    """``(key, problem)`` for an expert-parallel degree that does not fit the job, the data-parallel strategy,
    tensor parallelism or offloading (the schema's rule, :func:`parallel_dims` and the memory plan say the same).
    What it needs of the model (a mixture of experts whose count it divides)
    :func:`~toolkit.parallel.expert_parallel.check_expert_parallel` checks."""
    if expert_parallel == 1:
        return []
    problems = []
    if world_size is not None and (world_size % expert_parallel or expert_parallel > world_size):
        problems.append((
            "expert_parallel", f"{expert_parallel} does not divide the {world_size} data-parallel processes; choose "
            f"a divisor of {world_size}",
        ))
    if strategy is not None and strategy not in EXPERT_PARALLEL_STRATEGIES:
        problems.append((
            "data_parallel", f"{strategy} cannot combine with expert_parallel={expert_parallel} (the experts are "
            f"sharded by FSDP2 over the ranks that hold the same ones); use {' or '.join(EXPERT_PARALLEL_STRATEGIES)}",
        ))
    if tensor_parallel not in (1, None, "auto"):  # auto never splits MoE layers
        problems.append((
            "tensor_parallel", f"cannot combine with expert_parallel={expert_parallel} (mixture-of-experts layers are "
            "not split by tensor parallelism); use tensor_parallel=1",
        ))
    if cpu_offload:
        # parallelize shards an expert-parallel model on the meta device and materializes its shards on the GPU,
        # where FSDP2's offloading refuses them (it wants them on the CPU).
        problems.append((
            "cpu_offload", f"cannot combine with expert_parallel={expert_parallel} (not supported yet); use "
            "expert_parallel=1 with cpu_offload, or expert_parallel without it",
        ))
    return problems


def tensor_parallel_problems(
    *, tensor_parallel: int, world_size: int | None, strategy: str | None, cpu_offload: bool = False
) -> list[tuple[str, str]]:
    """``(key, problem)`` for a tensor-parallel degree that does not fit the job or the data-parallel strategy
    (the schema's rule and :func:`parallel_dims` say the same)."""
    if tensor_parallel == 1:
        return []
    problems = []
    if world_size is not None and tensor_parallel > world_size:
        # Without --nnodes a launch is one node: a TP group larger than it cannot be formed.
        problems.append((
            "tensor_parallel", f"{tensor_parallel} is more than the {world_size} processes of the launch; "
            f"tensor parallelism splits each layer within a node, so use at most {world_size} (a divisor of it), or "
            f"launch {tensor_parallel} processes per node",
        ))
    elif world_size is not None and world_size % tensor_parallel:
        problems.append((
            "tensor_parallel", f"{tensor_parallel} does not divide the {world_size} processes; choose a divisor of "
            f"{world_size}, or launch a multiple of {tensor_parallel} processes",
        ))
    if strategy == "zero1":
        problems.append((
            "data_parallel", f"zero1 cannot combine with tensor_parallel={tensor_parallel} (ZeroRedundancyOptimizer "
            "takes whole tensors, not tensor-parallel shards); use zero2, which shards the optimizer state too",
        ))
    if cpu_offload:
        problems.append((
            "cpu_offload", f"cannot combine with tensor_parallel={tensor_parallel} (not supported yet); "
            "use tensor_parallel=1 with cpu_offload, or a larger tensor_parallel without it",
        ))
    return problems
