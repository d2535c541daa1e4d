"""The shape of each parameter's tensor-parallel shard on one rank, without a process group: what the memory plan
(:mod:`toolkit.planning.memory`, ``tune plan``) counts for ``tensor_parallel: N``.

:func:`~toolkit.parallel.tensor_parallel.apply_tp` needs a device mesh, so it cannot run where the plan is made
(``tune plan`` has no processes; a recipe plans before it builds its mesh). This walks the model the way
``apply_tp`` does (:func:`~toolkit.parallel.tensor_parallel.split_modules`, the walk ``apply_tp`` itself splits
by, and its plans' placements), so a change to the plan there changes the counts here; the counts are checked
against a real ``apply_tp`` model on 2 processes (``tests/training/test_memory_tp.py``).
"""

import math

import torch
from torch import nn
from torch.distributed.tensor import Placement, Shard

from toolkit.parallel.tensor_parallel import check_tensor_parallel, split_modules


def tensor_parallel_placements(model: nn.Module) -> dict[int, Placement]:
    """``id(parameter) -> placement`` for every parameter ``apply_tp`` shards; the others are replicated."""
    placements: dict[int, Placement] = {}
    for module, plan in split_modules(model):
        for name, param in module.named_parameters():
            if name in plan.params and id(param) not in placements:
                placements[id(param)] = plan.params[name]
    return placements


def local_shape(shape: torch.Size, placement: Placement | None, *, tp: int) -> torch.Size:
    """The shape of the largest shard of a tensor of ``shape`` under ``placement`` over ``tp`` ranks (``None``:
    replicated). DTensor splits like ``torch.chunk``: the first ranks hold ``ceil(size / tp)``."""
    if not isinstance(placement, Shard) or tp == 1:
        return torch.Size(shape)
    dim = placement.dim % len(shape)
    sizes = list(shape)
    sizes[dim] = math.ceil(sizes[dim] / tp)
    return torch.Size(sizes)


def tensor_parallel_local_parameters(model: nn.Module, *, tp: int) -> dict[int, torch.Tensor]:
    """``id(parameter) -> a meta tensor of its shard's shape on one rank`` (``requires_grad`` kept), for a model
    ``tp`` ranks split; with ``tp`` 1, the parameters themselves.

    Raises:
        UserError: a model ``tp`` ranks cannot split (:func:`check_tensor_parallel`, the same refusal as
            ``apply_tp``'s).
    """
    if tp == 1:
        return {id(p): p for p in model.parameters()}
    check_tensor_parallel(model, tp=tp)
    placements = tensor_parallel_placements(model)
    local = {}
    for param in model.parameters():
        shape = local_shape(param.shape, placements.get(id(param)), tp=tp)
        local[id(param)] = torch.empty(shape, dtype=param.dtype, device="meta").requires_grad_(param.requires_grad)
    return local
