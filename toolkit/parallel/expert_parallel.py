"""Expert parallelism: the experts of each mixture-of-experts layer shared out over ``ep`` data-parallel ranks, the
tokens sent to their experts' ranks and back by all-to-all (GShard, Lepikhin et al., 2020,
https://arxiv.org/abs/2006.16668).

:func:`apply_ep` makes every stacked expert weight (and every expert adapter) a DTensor split along its experts
over the mesh's ``ep`` dimension, so rank ``r`` of an EP group of ``ep`` ranks holds experts ``[r E / ep, (r + 1)
E / ep)``, and wraps the experts' computation (:meth:`~toolkit.modules.moe.GroupedExperts.compute`) in the
exchange:

1. The rows (token assignments) arrive sorted by expert; each rank tells every other how many it sends to each of
   its experts (one small all-to-all), then sends them (an all-to-all of the rows).
2. The rows received, ordered by source rank then expert, are regrouped by expert and computed on this rank's
   experts in one grouped matmul per projection.
3. The outputs go back the way they came; the backward runs the same exchanges in reverse.

Each rank keeps its own data: the router, attention and every other parameter are data-parallel as before
(FSDP2 over all data-parallel ranks), and the experts are FSDP2-sharded over the ranks that hold the same ones
(``dp_shard_mod_ep``; :func:`~toolkit.parallel.data_parallel.apply_fsdp`). An expert's gradient arrives summed
over its EP group by the exchange's backward, then over the other groups by FSDP2, so it is divided by every
data-parallel rank rather than FSDP2's default of its own mesh: the same gradient as on one process.

Step checkpoints hold each expert weight whole (DCP reshards), so they resume on any EP degree.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from toolkit.errors import UserError
from toolkit.modules.moe import GroupedExperts, MoEFeedForward, permute_rows


def check_expert_parallel(model: nn.Module, *, ep: int) -> None:
    """Refuse, in one line naming the numbers, a model ``ep`` ranks cannot share the experts of: one without
    mixture-of-experts layers, or whose expert count ``ep`` does not divide."""
    blocks = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not blocks:
        raise UserError(f"expert_parallel: {ep} ranks have no experts to share out (the model has no "
                        "mixture-of-experts layers); remove expert_parallel")
    num_experts = blocks[0].num_experts
    if num_experts % ep:
        raise UserError(f"expert_parallel: {ep} ranks cannot share the model's {num_experts} experts; choose a "
                        f"divisor of {num_experts}")


def apply_ep(model: nn.Module, *, ep_mesh: DeviceMesh) -> nn.Module:
    """Share out the experts of every mixture-of-experts layer of ``model`` over ``ep_mesh`` (the mesh's ``ep``
    dimension), in place, before data parallelism: on the meta device, or filled (every rank holding the same
    whole experts, as an NF4 base is loaded: each keeps its own).

    Raises:
        UserError: see :func:`check_expert_parallel`.
    """
    ep = ep_mesh.size()
    check_expert_parallel(model, ep=ep)
    for experts in [m for m in model.modules() if isinstance(m, GroupedExperts)]:
        for module, name, param in _stacked_parameters(experts):
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)])
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        experts.compute = partial(_exchange, experts.compute, group=ep_mesh.get_group(), ep=ep)
    return model


def _stacked_parameters(experts: GroupedExperts) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """``(module, name, parameter)`` of every parameter of ``experts`` stacked along its experts (dim 0): the
    weights (an NF4 stack's codes and scales), and the adapters' (LoRAGroupedExperts)."""
    return [(module, name, param) for module in experts.modules()
            for name, param in module.named_parameters(recurse=False)]


def expert_parallel_local_parameters(model: nn.Module, *, ep: int) -> dict[int, torch.Tensor]:
    """``id(parameter) -> a meta tensor of its shape on one rank`` (``requires_grad`` kept) for every parameter
    :func:`apply_ep` splits over ``ep`` ranks: each rank's ``1/ep`` of the experts (by the same walk, so what
    ``apply_ep`` splits is what the memory plan counts split); empty for ``ep`` 1. Needs no process group.

    Raises:
        UserError: see :func:`check_expert_parallel`.
    """
    if ep == 1:
        return {}
    check_expert_parallel(model, ep=ep)
    return {
        id(param): torch.empty((param.shape[0] // ep, *param.shape[1:]), dtype=param.dtype, device="meta")
        .requires_grad_(param.requires_grad)
        for experts in model.modules() if isinstance(experts, GroupedExperts)
        for _, _, param in _stacked_parameters(experts)
    }


def _exchange(
    compute, routed: torch.Tensor, counts: torch.Tensor, *, group: dist.ProcessGroup, ep: int
) -> torch.Tensor:
    """``compute`` (the experts' SwiGLU on rows grouped by expert) with each group of rows computed on the rank
    that holds its expert: ``routed`` ``[rows, dim]`` sorted by expert, ``counts[e]`` of them for expert ``e``."""
    per_rank = counts.view(ep, -1)  # [destination rank, its local expert]
    received = torch.empty_like(per_rank)  # [source rank, my local expert]
    dist.all_to_all_single(received, per_rank, group=group)
    send_splits, receive_splits = per_rank.sum(dim=1).tolist(), received.sum(dim=1).tolist()
    rows = all_to_all_single_autograd(routed, receive_splits, send_splits, group)
    # The rows came ordered by source rank, then local expert: regroup them by local expert (stably: the same
    # order on every run).
    local_experts = received.shape[1]
    expert_of_row = torch.arange(local_experts, device=counts.device).repeat(ep).repeat_interleave(received.flatten())
    order = torch.argsort(expert_of_row, stable=True)
    out = compute(permute_rows(rows, order), received.sum(dim=0))
    back = torch.empty_like(out).index_copy_(0, order, out)
    return all_to_all_single_autograd(back, send_splits, receive_splits, group)
