"""The global gradient norm, over every rank's shards (data-parallel and tensor-parallel alike)."""

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


def clip_grad_norm(model: nn.Module, max_norm: float | None) -> float:
    """Clip the global gradient norm (over all ranks' shards) to ``max_norm``; return the norm before clipping.

    ``None`` only measures the norm. Sharded gradients (FSDP2's, tensor parallelism's) are DTensors: their norm is
    a DTensor, each shard counted once and each replicated gradient once, reduced over the mesh when made full.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
