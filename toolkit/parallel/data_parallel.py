"""Data parallelism applied to a plain (or tensor-parallel) model from outside: DDP, ZeRO-1/2/3 and HSDP on
PyTorch alone, over the data-parallel ranks of the mesh (see :mod:`toolkit.parallel.mesh` for the strategies).

The model knows nothing of this: transforms take the model and explicit keyword arguments.
"""

import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from toolkit.parallel.mesh import ParallelDims

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
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each decoder layer is one unit (gathered just before use), the rest (embedding,
    final norm, output) the root unit; under expert parallelism each layer's experts are a unit of their own.

    Args:
        model: the model (on the meta device, or materialized with its weights loaded), whose decoder layers its
            contract gives (:meth:`~toolkit.modules.contract.DecoderModel.decoder_layers`); its parameters may be
            tensor-parallel DTensors, whose local shards FSDP2 then shards further (2-D).
        mesh: 1-D for ZeRO-2/3, 2-D ``(dp_replicate, dp_shard)`` for HSDP (:meth:`ParallelDims.fsdp_mesh`).
        reshard_after_forward: free gathered layer parameters after forward (ZeRO-3) or keep them until backward
            (ZeRO-2: more memory, one all-gather per layer fewer).
        mp_policy: parameter (compute) and gradient-reduction dtypes.
        cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
        expert_mesh: under expert parallelism (experts already split over the mesh's ``ep`` dimension,
            :func:`~toolkit.parallel.expert_parallel.apply_ep`), the ranks holding the same experts, which FSDP2
            shards them over (:meth:`ParallelDims.expert_fsdp_mesh`).
    """
    kwargs = {
        "mesh": mesh,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        # Pinned host memory copies to and from a GPU asynchronously; a CPU mesh (tests) has nothing to pin for.
        "offload_policy": CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu") if cpu_offload else None,
    }
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    for layer in model.decoder_layers().values():
        experts = getattr(layer.mlp, "experts", None)
        if expert_mesh is not None and experts is not None:
            fully_shard(experts, reshard_after_forward=reshard_after_forward, **{**kwargs, "mesh": expert_mesh})
            # Their gradients come summed over the EP group by the token exchange's backward, and FSDP2 sums them
            # over the other groups: divided by every data-parallel rank, as the other parameters' are.
            experts.set_gradient_divide_factor(float(mesh.size()))
            # Gloo has no pre-multiplied sum: sum, then divide. (Not over one rank, which sends nothing: there torch
            # would divide twice, in its copy and after it.)
            if expert_mesh.device_type == "cpu" and expert_mesh.size() > 1:
                experts.set_force_sum_reduction_for_comms(True)
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
    mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply ``dims.strategy`` to ``model`` over the data-parallel ranks; a no-op for one data-parallel rank.

    ``mesh`` is the job's mesh (:meth:`ParallelDims.build_mesh`), built here when not given; a tensor-parallel
    model must get the mesh its TP submesh came from.
    """
    if dims.dp_size == 1:
        return model
    if not dims.uses_fsdp:  # ddp and zero1 on plain tensors
        return apply_ddp(model, device=device)
    mesh = mesh if mesh is not None else dims.build_mesh(device.type)
    return apply_fsdp(
        model,
        mesh=dims.fsdp_mesh(mesh),
        # ZeRO-2 keeps layers gathered until backward; under ddp (a shard group of one) there is nothing to gather.
        reshard_after_forward=dims.strategy not in ("zero2", "ddp"),
        mp_policy=mp_policy,
        cpu_offload=dims.cpu_offload,
        expert_mesh=dims.expert_fsdp_mesh(mesh) if dims.ep > 1 else None,
    )


def shard_optimizer_state(optimizer: Optimizer, *, dims: ParallelDims) -> Optimizer:
    """For ZeRO-1, rebuild ``optimizer`` as a ZeroRedundancyOptimizer: each rank keeps the state of, and updates,
    its share of the parameters, then broadcasts them. Other strategies return it unchanged (FSDP2 already shards
    optimizer state, since it sees only each rank's shard), except that under DDP an optimizer that can divide work
    over replicas (:meth:`~toolkit.optim.Muon.share_orthogonalization`) is told to.

    An optimizer whose groups are its own (``algorithm`` in each, as Muon's) keeps them: ZeRO-1 hands each rank's
    share of every group back to its class."""
    if dims.dp_size == 1:
        return optimizer
    if dims.strategy == "ddp" and not dims.uses_fsdp and hasattr(optimizer, "share_orthogonalization"):
        return optimizer.share_orthogonalization(None)  # (every rank holds the same whole matrices)
    if dims.strategy != "zero1":
        return optimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer  # see is_zero_redundancy

    if all("algorithm" in group for group in optimizer.param_groups):
        return ZeroRedundancyOptimizer([dict(group) for group in optimizer.param_groups],
                                       optimizer_class=type(optimizer))
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
    """The plain model inside a DDP wrapper (FSDP2 and TP transform in place, so the model itself otherwise)."""
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
