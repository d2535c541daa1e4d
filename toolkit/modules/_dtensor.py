"""Filling sharded (DTensor) parameters with exactly the values their whole tensor would get."""

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_region(sharded: DTensor) -> tuple[slice, ...]:
    """Where this rank's part of ``sharded`` lies in the global tensor: one slice per dimension."""
    shape, offset = compute_local_shape_and_global_offset(sharded.shape, sharded.device_mesh, sharded.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def local_part(full: torch.Tensor | Any, sharded: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` (anything sliceable with the global shape: a tensor, a safetensors slice) as
    ``sharded`` places it."""
    return full[local_region(sharded)]


def copy_full_(target: torch.Tensor, full: torch.Tensor) -> None:
    """``target.copy_(full)`` where ``target`` may be sharded: then only this rank's part is copied."""
    if isinstance(target, DTensor):
        target.to_local().copy_(local_part(full, target))
    else:
        target.copy_(full)


def init_full_(param: torch.Tensor, init: Callable[[torch.Tensor], Any]) -> None:
    """Apply the in-place initializer ``init`` (``nn.init.normal_``...) to ``param``.

    A sharded parameter gets exactly the values an unsharded one would: the whole tensor is drawn on the same
    device with the same random calls (so every rank consumes the generator alike), and each rank keeps its part.
    That device is the mesh's: a part kept in host memory (FSDP2's CPU offload) gets the values drawn on the GPU.
    """
    if not isinstance(param, DTensor):
        init(param)
        return
    local = param.to_local()
    full = torch.empty(param.shape, dtype=local.dtype, device=_mesh_device(local, param.device_mesh))
    init(full)
    local.copy_(local_part(full, param))


def on_mesh_device(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``local`` on the device ``mesh``'s collectives take: FSDP2's CPU offload keeps shards (and their gradients)
    in host memory, and NCCL takes GPU tensors only ("No backend type associated with device type cpu")."""
    return local.to(_mesh_device(local, mesh))  # (itself where it is there already)


def _mesh_device(local: torch.Tensor, mesh: DeviceMesh) -> torch.device:
    # ``local``'s own device where it is of the mesh's type (keeping its index), else the mesh's current one.
    return local.device if local.device.type == mesh.device_type else torch.device(mesh.device_type)


def full_tensor(sharded: DTensor) -> torch.Tensor:
    """``sharded`` gathered whole (a collective: every rank of its mesh calls it), also where its local part is in
    host memory (CPU offload); the result is on the mesh's device."""
    local = sharded.to_local()
    moved = on_mesh_device(local, sharded.device_mesh)
    if moved is not local:
        sharded = DTensor.from_local(moved, sharded.device_mesh, sharded.placements, shape=sharded.shape,
                                     stride=sharded.stride(), run_check=False)
    return sharded.full_tensor()
