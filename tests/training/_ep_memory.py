"""What a real expert-parallel model holds on each rank, for test_memory_ep.py's comparison with the memory plan;
measured inside the 4-process launch of :mod:`tests.training._ep_worker` (a launch of its own would cost as much as
what it measures), during the first step of each layout it trains, and in the one-process reference.

:class:`Meter` records, on this rank:

- the bytes of its parameters and buffers, of its gradients before the optimizer step and of its optimizer state
  after it (local shards; the scalar ``step`` counters aside);
- the peak, in forward and in backward, of the parameter bytes FSDP2 holds unsharded: every unit gathered, and
  every all-gather buffer not yet copied out or freed (sampled each time autograd saves a tensor in forward and
  each time backward reads one back: while layers compute, which is when the plan counts them);
- the bytes the mixture-of-experts blocks save for backward in each micro-batch (storages counted once,
  parameters' not at all), with the micro-batch's token count.
"""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule

from tests.training._tp_memory import local_bytes
from toolkit.modules.moe import MoEFeedForward, local


def _storage_bytes(tensors: Iterator[torch.Tensor]) -> dict[int, int]:
    storages = (_plain(t).untyped_storage() for t in tensors)
    return {storage.data_ptr(): storage.nbytes() for storage in storages}


def _plain(t: torch.Tensor) -> torch.Tensor:
    # The tensor holding the data: a DTensor's local one, or the one an all-to-all's AsyncCollectiveTensor wraps
    # (the exchange's received rows, saved as they are by the unsort that follows).
    t = local(t)
    return t.elem if isinstance(t, AsyncCollectiveTensor) else t


def _gathered(groups: list) -> dict[int, int]:
    """``{storage: bytes}`` of the parameters FSDP2 holds unsharded now, in its parameter ``groups``: the units
    gathered, all-gather outputs waiting to be copied out (a prefetch), and the buffer forward keeps until the next
    unit is copied out."""
    held = {}
    for group in groups:
        if group.is_unsharded:
            held.update(_storage_bytes(p.unsharded_param for p in group.fsdp_params))
        if group._all_gather_result is not None:
            held.update(_storage_bytes(iter([group._all_gather_result.all_gather_output])))
    kept = groups[0].comm_ctx.all_gather_state if groups else None
    if kept is not None:
        held.update(_storage_bytes(iter([kept.all_gather_result.all_gather_output])))
    return held


class Meter:
    """The numbers of the module docstring, for one model (see :meth:`watch`, :meth:`grads`, :meth:`state`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.numbers = {"forward_gathered": 0, "backward_gathered": 0, "moe_saved": [], "tokens": []}

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Record the gathered peaks and the MoE blocks' saved tensors of what runs inside."""
        inside, saved = [False], {}
        groups = [group for module in self.model.modules() if isinstance(module, FSDPModule)
                  for group in module._get_fsdp_state()._fsdp_param_groups]
        parameters = _storage_bytes(self.model.parameters())  # as registered now: FSDP2's shards, or the whole ones

        def enter(_module, args) -> None:
            inside[0] = True
            if not saved:  # the first block of a micro-batch: its tokens
                self.numbers["tokens"].append(args[0].shape[0] * args[0].shape[1])

        def leave(*_) -> None:
            inside[0] = False

        def pack(t: torch.Tensor) -> torch.Tensor:
            gathered = self._peak("forward_gathered", groups)
            if inside[0]:
                ((data, size),) = _storage_bytes(iter([t])).items()
                if data not in parameters and data not in gathered:
                    saved.setdefault(data, size)
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            self._peak("backward_gathered", groups)
            if saved:  # forward is over: the micro-batch's blocks saved all they save
                self.numbers["moe_saved"].append(sum(saved.values()))
                saved.clear()
            return t

        blocks = [m for m in self.model.modules() if isinstance(m, MoEFeedForward)]
        hooks = [h for b in blocks for h in (b.register_forward_pre_hook(enter), b.register_forward_hook(leave))]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def _peak(self, key: str, groups: list) -> dict[int, int]:
        gathered = _gathered(groups)
        self.numbers[key] = max(self.numbers[key], sum(gathered.values()))
        return gathered

    def grads(self) -> None:
        """Record the gradients (call it after backward, before the optimizer step)."""
        self.numbers["grads"] = local_bytes(p.grad for p in self.model.parameters() if p.grad is not None)

    def state(self, optimizer: torch.optim.Optimizer) -> None:
        """Record the parameters, buffers and optimizer state (call it after the optimizer step)."""
        states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and local(t).dim() > 0]
        self.numbers["params"] = local_bytes(self.model.parameters()) + local_bytes(self.model.buffers())
        self.numbers["optimizer_state"] = local_bytes(states)
