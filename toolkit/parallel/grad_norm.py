"""The global gradient norm, over every rank's shards (data-parallel and tensor-parallel alike)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from toolkit.modules._dtensor import on_mesh_device


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip the global gradient norm (over all ranks' shards) to ``max_norm``; return the norm before clipping.

    ``None`` only measures the norm. The gradients are scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = global_norm(grads)
    if max_norm is not None:
        coefficient = min(1.0, max_norm / (norm + 1e-6))
        if coefficient < 1.0:
            torch._foreach_mul_(grads, coefficient)
    return norm


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of ``tensors`` taken together, each counted once however it is split over the ranks.

    Sharded gradients (FSDP2's, tensor parallelism's) are DTensors. Each rank sums the squares of its local parts;
    the sums of the DTensors laid out alike (mesh and placements) are then added up over the ranks that hold
    different shards, in one collective per layout (a handful), rather than in one per parameter as the norms of
    DTensors are. A replicated part is the same on every rank holding it, so it is not summed over those.
    """
    parts: dict[tuple | None, list[torch.Tensor]] = {}
    for t in tensors:
        layout = None
        if isinstance(t, DTensor):
            if any(p.is_partial() for p in t.placements):  # an unreduced gradient: reduce it first
                t = t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])
            layout = (t.device_mesh, t.placements)
            t = t.to_local()
        parts.setdefault(layout, []).append(t)
    total = torch.zeros((), dtype=torch.float32)
    for layout, local in parts.items():
        # One multi-tensor kernel for all of a layout's norms on CUDA (a profile of a 3B step found 254 norm kernels
        # and as many squares and adds, launched one by one), then their squares summed.
        square = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float32)).square().sum()
        if layout is not None:  # (gradients offloaded to host memory: the sum goes over the mesh's device)
            square = _sum_over_shards(on_mesh_device(square, layout[0]), *layout)
        total = total + square.cpu()
    return float(total.sqrt())


def _sum_over_shards(square: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """``square`` summed over the mesh dimensions along which the tensors are split (strided shards too), in one
    all-reduce: over a 2-D split (ZeRO-3 x TP) DTensor would reduce one dimension after the other, two collectives
    and a warning saying so on every rank."""
    split = [i for i, p in enumerate(placements) if not p.is_replicate()]
    if not split:
        return square
    names = mesh.mesh_dim_names
    if len(split) == 1 or names is None or not hasattr(DeviceMesh, "_flatten"):
        summed = [Replicate() if p.is_replicate() else Partial() for p in placements]
        return DTensor.from_local(square, mesh, summed, run_check=False).full_tensor()
    # DeviceMesh has no public flatten; _flatten is how torchtitan makes the same group (made once, then cached).
    group = mesh[tuple(names[i] for i in split)]._flatten().get_group()
    square = square.clone()
    dist.all_reduce(square, group=group)
    return square
