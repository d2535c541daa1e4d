"""Data parallelism applied to a plain model from outside: DDP, ZeRO-1/2/3 stages and HSDP on PyTorch alone.

| strategy | parameters            | gradients | optimizer state | built on                                  |
|----------|-----------------------|-----------|-----------------|-------------------------------------------|
| ddp      | replicated            | replicated| replicated      | DistributedDataParallel                   |
| zero1    | replicated            | replicated| sharded         | DDP + ZeroRedundancyOptimizer             |
| zero2    | sharded, kept gathered from forward to backward | sharded | sharded | FSDP2, reshard_after_forward=False |
| zero3    | sharded               | sharded   | sharded         | FSDP2, reshard_after_forward=True         |
| hsdp     | sharded within a group of ``shard_size`` ranks, replicated across groups | | | FSDP2 on a 2-D mesh |

The model knows nothing of this: transforms take the model and explicit keyword arguments.
"""

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from toolkit.errors import UserError
from toolkit.modules.peft.nf4 import is_nf4
from toolkit.training.activations import (
    apply_activation_checkpointing,
    apply_activation_offloading,
    checkpoint_interval,
)
from toolkit.training.init import materialize

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
SHARDED_STRATEGIES = ("zero2", "zero3", "hsdp")


@dataclass(frozen=True)
class ParallelDims:
    """The data-parallel layout: ``world_size = replicate x shard``.

    Attributes:
        strategy: one of :data:`STRATEGIES`.
        world_size: all data-parallel ranks.
        shard: ranks a parameter is sharded over (1 for ddp/zero1; world_size for zero2/zero3).
        replicate: groups holding a full replica (world_size / shard).
        cpu_offload: sharded parameters, gradients and optimizer state live in host memory.
    """

    strategy: str
    world_size: int
    shard: int
    replicate: int
    cpu_offload: bool = False

    @property
    def is_sharded(self) -> bool:
        """Whether FSDP2 shards the model (never for one process: it is then left unwrapped)."""
        return self.strategy in SHARDED_STRATEGIES and self.world_size > 1

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """The device mesh FSDP2 shards over (2-D ``(replicate, shard)`` for HSDP), or None when unsharded."""
        if not self.is_sharded:
            return None
        if self.strategy == "hsdp":
            return init_device_mesh(device_type, (self.replicate, self.shard), mesh_dim_names=("replicate", "shard"))
        return init_device_mesh(device_type, (self.world_size,), mesh_dim_names=("shard",))


def parallel_dims(
    *,
    strategy: str,
    world_size: int,
    local_world_size: int,
    shard_size: int | None = None,
    cpu_offload: bool = False,
    device_type: str = "cuda",
) -> ParallelDims:
    """Check a strategy against the job's shape and return its layout.

    Args:
        strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``hsdp`` (``auto`` is resolved before this).
        world_size: data-parallel ranks.
        local_world_size: ranks per node; HSDP shards within a node by default.
        shard_size: HSDP's shard group size (default: ``local_world_size``).
        cpu_offload: offload sharded state to host memory (sharded strategies only).
        device_type: ``cuda`` or ``cpu``; offloading needs an accelerator to offload from.

    Raises:
        UserError: an unknown strategy, ``cpu_offload`` without sharding or without a GPU, or an HSDP shape that
            does not divide.
    """
    if strategy not in STRATEGIES:
        raise UserError(f"data_parallel: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or auto")
    if cpu_offload and strategy not in SHARDED_STRATEGIES:
        raise UserError(
            f"cpu_offload: needs a sharded strategy ({', '.join(SHARDED_STRATEGIES)}), not data_parallel={strategy}"
        )
    if cpu_offload and device_type == "cpu":
        raise UserError("cpu_offload: training already runs on the CPU (no GPU found); remove cpu_offload")
    if strategy == "hsdp":
        shard = shard_size or local_world_size
        if shard < 1 or world_size % shard:
            raise UserError(
                f"hsdp_shard_size: a world size of {world_size} cannot be split into shard groups of {shard}; "
                f"choose a divisor of {world_size}"
            )
        return ParallelDims(strategy, world_size, shard, world_size // shard, cpu_offload)
    shard = world_size if strategy in ("zero2", "zero3") else 1
    return ParallelDims(strategy, world_size, shard, world_size // shard, cpu_offload)


# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns); torch >= 2.9 is supported.
_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else {"broadcast_buffers": False}
)


def apply_ddp(model: nn.Module, *, device: torch.device) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel (its parameters already on ``device``).

    Only parameters with ``requires_grad`` are registered for all-reduce, so with a frozen base (LoRA) only
    the adapters' gradients cross the network. Frozen parameters are not broadcast from rank 0 at the start
    either: every rank built or loaded the same base, broadcasting a 70B base would take minutes, and broadcasting
    an NF4 (QLoRA) weight goes through its dequantized values and re-quantizes it, changing the base slightly.
    """
    frozen = [name for name, param in model.named_parameters() if not param.requires_grad]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        # Every trainable parameter gets a gradient each step in our models; saying so skips the graph
        # traversal that find_unused_parameters would need.
        find_unused_parameters=False,
        # Our buffers (rotary tables) are computed the same on every rank: broadcasting them before each forward
        # would cost a collective per micro-step for nothing.
        **_NO_BUFFER_SYNC,
        # Reuse gradient buckets as .grad storage: less memory and one copy fewer per step.
        gradient_as_bucket_view=True,
    )


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each decoder layer is one unit (gathered just before use), the rest (embedding,
    final norm, output) the root unit.

    Args:
        model: a materialized model (weights already loaded).
        mesh: 1-D for ZeRO-2/3, 2-D ``(replicate, shard)`` for HSDP.
        reshard_after_forward: free gathered layer parameters after forward (ZeRO-3) or keep them until backward
            (ZeRO-2: more memory, one all-gather per layer fewer).
        mp_policy: parameter (compute) and gradient-reduction dtypes.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
    """
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else None,
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's parameters are needed again at the start of backward (the output projection), so keep them.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def apply_data_parallel(
    model: nn.Module,
    *,
    dims: ParallelDims,
    device: torch.device,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Apply ``dims.strategy`` to ``model``; a no-op for a single process."""
    if dims.world_size == 1:
        return model
    if dims.strategy in ("ddp", "zero1"):
        return apply_ddp(model, device=device)
    return apply_fsdp(
        model,
        mesh=dims.build_mesh(device.type),
        reshard_after_forward=dims.strategy != "zero2",
        mp_policy=mp_policy,
        cpu_offload=dims.cpu_offload,
    )


def shard_optimizer_state(optimizer: Optimizer, *, dims: ParallelDims) -> Optimizer:
    """For ZeRO-1, rebuild ``optimizer`` as a ZeroRedundancyOptimizer: each rank keeps the state of, and updates,
    its share of the parameters, then broadcasts them. Other strategies return it unchanged (FSDP2 already shards
    optimizer state, since it sees only each rank's shard)."""
    if dims.strategy != "zero1" or dims.world_size == 1:
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer  # see is_zero_redundancy

    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return ZeroRedundancyOptimizer(params, optimizer_class=type(optimizer), **defaults)


def is_zero_redundancy(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is ZeRO-1's ZeroRedundancyOptimizer, without importing ``torch.distributed.optim``
    where nothing made one: that package compiles its eight functional optimizers with TorchScript on import, most
    of a second in every process that never uses it."""
    module = sys.modules.get("torch.distributed.optim")
    return module is not None and isinstance(optimizer, module.ZeroRedundancyOptimizer)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (FSDP2 shards in place, so the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Skip DDP's gradient all-reduce inside the block when ``enabled`` is False.

    Use it on every micro-step but the last of an optimizer step: gradients accumulate locally and are reduced
    once per optimizer step instead of once per micro-step. FSDP2 always reduce-scatters: skipping it would keep
    full, unsharded fp32 gradients on every rank between micro-steps (32 GB for an 8B model), undoing the point
    of sharding gradients; the sharded gradients then accumulate in place.
    """
    if enabled or not isinstance(model, DistributedDataParallel):
        yield
        return
    with model.no_sync():
        yield


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip the global gradient norm (over all ranks' shards) to ``max_norm``; return the norm before clipping.

    ``None`` only measures the norm.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if isinstance(norm, DTensor):  # sharded gradients: the norm is a DTensor, reduced when made full
        norm = norm.full_tensor()
    return float(norm)


def parallelize(
    model: nn.Module,
    *,
    dims: ParallelDims,
    device: torch.device,
    dtype: torch.dtype,
    fill: Callable[[nn.Module], None],
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool | int = False,
    activation_offloading: bool = False,
) -> nn.Module:
    """Turn a meta-device ``model`` into the trainable, data-parallel model, in the order that needs least memory.

    ``fill(model)`` puts the weights in (loads a checkpoint or initializes); it receives the model materialized on
    ``device`` in ``dtype``. Sharded strategies (ZeRO-2/3, HSDP) shard while the model is still on the meta
    device, so each rank only ever allocates its shard, and ``fill`` writes each rank's part (checkpoint loaders
    read only those rows; initializers draw the whole tensor and keep the part, giving every rank count the same
    values). DDP and ZeRO-1 keep whole copies, so they wrap the model once it is filled; so do CPU offload and
    NF4 (QLoRA) bases, whose weights FSDP2 takes whole.

    ``activation_checkpointing`` (true, or k for every k-th layer) and ``activation_offloading`` wrap the layers
    first, checkpointing inside offloading, so that only checkpointed layers' inputs are offloaded (see
    :mod:`toolkit.training.activations`); offloading does nothing on a CPU.
    """
    every_k_layers = checkpoint_interval(activation_checkpointing)
    if every_k_layers:
        apply_activation_checkpointing(model, every_k_layers=every_k_layers)
    if activation_offloading:
        apply_activation_offloading(model, device=device)
    shard_first = dims.world_size > 1 and dims.is_sharded and not dims.cpu_offload and not any(
        is_nf4(p) for p in model.parameters()
    )
    if shard_first:
        model = apply_data_parallel(model.to(dtype), dims=dims, device=device, mp_policy=mp_policy)
    materialize(model, device=device, dtype=None if shard_first else dtype)
    fill(model)
    if not shard_first:
        model = apply_data_parallel(model, dims=dims, device=device, mp_policy=mp_policy)
    return model
