"""Preparing the trainable model: activation checkpointing and offloading, tensor and data parallelism
(:mod:`toolkit.parallel`), then the weights, in the order that needs least memory.

It lives here rather than in :mod:`toolkit.parallel` because it composes that package's transforms with the
training step's own (activation checkpointing, materializing a meta-device model), and ``toolkit.parallel`` does
not import ``toolkit.training``.
"""

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from toolkit.modules.peft.nf4_experts import has_nf4
from toolkit.parallel import ParallelDims, apply_data_parallel, apply_ep, apply_tp
from toolkit.training.activations import (
    apply_activation_checkpointing,
    apply_activation_offloading,
    checkpoint_interval,
)
from toolkit.training.init import materialize


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
    mesh: DeviceMesh | None = None,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Turn a meta-device ``model`` into the trainable, parallel model, in the order that needs least memory.

    ``fill(model)`` puts the weights in (loads a checkpoint or initializes); it receives the model materialized on
    ``device`` in ``dtype``. Tensor parallelism (``dims.tp`` > 1) and the sharded strategies (ZeRO-2/3, HSDP) split
    the model while it is still on the meta device, so each rank only ever allocates its part, and ``fill`` writes
    each rank's part (checkpoint loaders read only those rows; initializers draw the whole tensor and keep the part,
    giving every layout the same values). DDP and ZeRO-1 without TP keep whole copies, so they wrap the model once
    it is filled; so do NF4 (QLoRA) bases, whose weights FSDP2 takes whole.

    Under ``dims.cpu_offload`` the parameters are allocated (and filled) in host memory, where FSDP2 keeps their
    shards, and the buffers (rotary tables) on ``device``, where the layers run: a model that only fits the GPU in
    shards never passes through it whole. (An NF4 base is filled whole in host memory, then FSDP2 moves one layer
    at a time to the device to split it.)

    Expert parallelism (``dims.ep`` > 1) splits the experts over the ranks of an EP group, on the meta device too
    (:func:`~toolkit.parallel.apply_ep`); with an NF4 base, once it is filled, as FSDP2 does.

    ``mesh`` is the job's device mesh (:meth:`ParallelDims.build_mesh`), built here when needed and not given;
    pass the one the run built, so that every dimension comes from one mesh. ``sequence_parallel`` splits the
    residual stream and norms along the sequence too (:func:`~toolkit.parallel.apply_tp`; with ``dims.tp`` > 1).

    ``activation_checkpointing`` (true, or k for every k-th layer) and ``activation_offloading`` wrap the layers
    first, checkpointing inside offloading, so that only checkpointed layers' inputs are offloaded (see
    :mod:`toolkit.training.activations`); offloading does nothing on a CPU.
    """
    every_k_layers = checkpoint_interval(activation_checkpointing)
    if every_k_layers:
        apply_activation_checkpointing(model, every_k_layers=every_k_layers)
    if activation_offloading:
        apply_activation_offloading(model, device=device)
    if mesh is None and (dims.tp > 1 or dims.uses_fsdp):
        mesh = dims.build_mesh(device.type)
    # NF4 bases load whole on every rank: a shard quantized on its own would hold other values than the whole
    # weight quantized (one process's), so they are split only once filled.
    nf4 = has_nf4(model)
    if dims.tp > 1:
        apply_tp(model, tp_mesh=mesh["tp"], sequence_parallel=sequence_parallel)
    if dims.ep > 1 and not nf4:
        apply_ep(model, ep_mesh=mesh["ep"])
    shard_first = dims.tp > 1 or (dims.ep > 1 and not nf4) or (dims.is_sharded and not nf4)
    if shard_first:
        model = apply_data_parallel(model.to(dtype), dims=dims, device=device, mp_policy=mp_policy, mesh=mesh)
    materialize(
        model, device=torch.device("cpu") if dims.cpu_offload else device, dtype=None if shard_first else dtype,
        buffer_device=device,
    )
    fill(model)
    if dims.ep > 1 and nf4:
        apply_ep(model, ep_mesh=mesh["ep"])
    if not shard_first:
        model = apply_data_parallel(model, dims=dims, device=device, mp_policy=mp_policy, mesh=mesh)
    return model
