"""One optimizer step: micro-batches forward and backward with exact loss normalization, then the update."""

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer

from toolkit.data import GlobalBatchSampler

from toolkit.parallel.context_parallel import ContextParallel
from toolkit.training.attention_backend import split_for_attention
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.training.accumulation import gradient_scale, start_global_token_count
from toolkit.optim.optimizers import OptimizerInBackward
from toolkit.training.watchdog import progress
from toolkit.parallel import clip_grad_norm, gradient_sync, unwrap

T = TypeVar("T")


@dataclass(frozen=True)
class StepResult:
    """What an optimizer step computed.

    Attributes:
        loss: mean token loss over the whole global batch (all micro-batches and ranks).
        num_tokens: non-ignored tokens in the global batch.
        num_positions: this rank's input positions, padding included (for throughput).
        metrics: further ``metrics.jsonl`` figures of the step: a mixture-of-experts model's
            :func:`routing_metrics` of the global batch, a preference step's rewards; else empty.
    """

    loss: float
    num_tokens: int
    num_positions: int
    metrics: dict[str, float] = field(default_factory=dict)


def forward_backward(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    device: torch.device,
    data_parallel_size: int,
    data_parallel_group: dist.ProcessGroup | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    num_output_chunks: int | None = None,
    fused_loss: bool = True,
    flex_attention: bool = False,
    context_parallel: ContextParallel | None = None,
) -> StepResult:
    """Accumulate the gradients of one global batch's share on this rank.

    The global count of trained tokens is taken first (one small all-reduce), so each micro-batch contributes
    ``sum of its token losses / N_global``: the accumulated, reduced gradient is that of the mean over the whole
    global batch, whatever the split into ranks and micro-steps. Gradients are reduced across ranks only on the
    last micro-batch.

    Args:
        model: the (data-parallel) model.
        micro_batches: this rank's micro-batches of the step (``tokens``, ``labels``, optional ``mask`` and
            ``input_pos``).
        device: where to run.
        data_parallel_size: ranks the gradient reduction averages over.
        data_parallel_group: those ranks' process group, over which the tokens and the logged loss are summed
            (default: all ranks; under tensor parallelism ``ParallelDims.dp_group``, since the ranks of a TP group
            compute the same micro-batches).
        autocast: forward-pass context (mixed precision without FSDP2).
        grad_scaler: fp16 loss scaling.
        loss_fn: None: the model computes the token cross-entropy sum itself, given the labels (the decoder's
            ``labels=``; see ``fused_loss``). Otherwise a function of the logits and labels that returns the *sum*
            of token losses of a micro-batch; with ``num_output_chunks``, one taking the list of logit chunks
            (:func:`~toolkit.modules.loss.chunked_cross_entropy_sum`).
        num_output_chunks: the loss over this many chunks of positions, so that it never holds the logits whole in
            float32 (``None``: one); with a ``loss_fn``, the model returns its logits in this many sequence chunks.
        fused_loss: without a ``loss_fn``, the model projects and takes the loss together, chunk by chunk, keeping
            no logits (:func:`~toolkit.modules.loss.linear_cross_entropy_sum`), where its output layer allows.
        flex_attention: attend with FlexAttention block masks (:func:`~toolkit.training.resolve_flex_attention`).
        context_parallel: this rank's context-parallel group (:meth:`ParallelDims.context_parallel
            <toolkit.parallel.ParallelDims.context_parallel>`): every micro-batch is cut to this rank's positions of
            each row first, so the loss, the token count and the gradient are those of its positions (the ranks of the
            group are data-parallel ranks in ``data_parallel_size`` and ``data_parallel_group``).
    """
    output_kwargs = {} if num_output_chunks is None else {"num_output_chunks": num_output_chunks}
    if loss_fn is None:
        output_kwargs["fused_loss"] = fused_loss
    # The global token count travels during the first forward; it is waited for before the first backward. (Under
    # context parallelism each rank counts its positions' labels: the group's counts add up to its rows'.)
    labels = [mb["labels"] if context_parallel is None else context_parallel.local(mb["labels"]) for mb in micro_batches]
    wait_for_token_count = start_global_token_count(labels, group=data_parallel_group)
    num_tokens = scale = None
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    num_positions = 0
    for i, mb in enumerate(micro_batches):
        progress("a micro-batch")
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast or contextlib.nullcontext():
                # Packed batches carry positions that restart per document; attention stays within each document.
                mb, mask = split_for_attention(mb, flex_attention=flex_attention, context_parallel=context_parallel)
                num_positions += mb["tokens"].numel()
                if loss_fn is None:
                    micro_loss = model(
                        mb["tokens"], mask=mask, input_pos=mb.get("input_pos"), labels=mb["labels"],
                        lengths=mb.get("lengths"), **output_kwargs,
                    )
                else:
                    logits = model(mb["tokens"], mask=mask, input_pos=mb.get("input_pos"), **output_kwargs)
            if loss_fn is not None:
                micro_loss = loss_fn(logits, mb["labels"])
                del logits  # the backward frees the logits (chunk by chunk) as it uses them
            if scale is None:
                num_tokens = wait_for_token_count()
                scale = gradient_scale(global_tokens=num_tokens, data_parallel_size=data_parallel_size)
            scaled = micro_loss * scale
            (grad_scaler.scale(scaled) if grad_scaler is not None else scaled).backward()
        loss_sum += micro_loss.detach().float()
    loss = all_reduce_sum(loss_sum, group=data_parallel_group).item() / max(num_tokens, 1)
    metrics = taken_routing_metrics(model, num_tokens=num_tokens, group=data_parallel_group)
    return StepResult(loss=loss, num_tokens=num_tokens, num_positions=num_positions, metrics=metrics)


def taken_routing_metrics(
    model: nn.Module, *, num_tokens: int, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """:func:`routing_metrics` of what ``model``'s routers did since this was last called (its
    :meth:`~toolkit.modules.TransformerDecoder.take_routing_totals`, ``num_tokens`` the sequences or tokens the
    load-balancing loss was averaged over); empty for a model without experts. A collective when it has them."""
    take = getattr(unwrap(model), "take_routing_totals", None)
    routing = take() if take is not None else None
    return {} if routing is None else routing_metrics(routing, num_tokens=num_tokens, group=group)


def routing_metrics(
    totals: dict[str, torch.Tensor], *, num_tokens: int, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """The ``metrics.jsonl`` figures of a step's expert routing, from each rank's
    :meth:`~toolkit.modules.TransformerDecoder.take_routing_totals` summed over ``group`` (a collective).

    ``router_aux_loss`` is the load-balancing loss's part of ``loss``; ``expert_load_min`` and ``expert_load_max``
    the fewest and most token assignments one expert of one layer got in the global batch; and
    ``expert_load_busiest_share`` the largest share of a layer's assignments that went to one expert (``1 /
    num_experts`` when perfectly balanced, 1 when the router has collapsed onto one expert).
    """
    load = totals["tokens_per_expert"]  # [layers, experts]
    summed = all_reduce_sum(torch.cat([totals["aux_loss_sum"].reshape(1), load.flatten()]).cpu(), group=group)
    aux_loss_sum, load = summed[0], summed[1:].view_as(load)
    return {
        "router_aux_loss": float(aux_loss_sum) / max(num_tokens, 1),
        "expert_load_min": float(load.min()),
        "expert_load_max": float(load.max()),
        "expert_load_busiest_share": float((load.max(dim=-1).values / load.sum(dim=-1).clamp(min=1)).max()),
    }


def optimizer_step(
    model: nn.Module,
    optimizer: Optimizer,
    *,
    max_grad_norm: float | None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> float | None:
    """Unscale (fp16), clip the global gradient norm, step, and clear the gradients; returns the norm.

    With the step inside backward (:class:`~toolkit.optim.optimizers.OptimizerInBackward`) every parameter is already
    updated and its gradient gone, so there is nothing to do and no global norm (None).
    """
    if isinstance(optimizer, OptimizerInBackward):
        optimizer.step()  # a no-op, which the LR scheduler expects before its own step
        return None
    if grad_scaler is not None:
        grad_scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(model, max_grad_norm)
    if grad_scaler is not None:
        grad_scaler.step(optimizer)  # skipped when the gradients overflowed
        grad_scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def make_grad_scaler(
    *, enabled: bool, device: torch.device, sharded: bool, data_parallel_size: int = 1, init_scale: float = 2.0**16
) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16; the sharded variant agrees on overflow across ranks.

    :func:`forward_backward` multiplies each rank's loss by ``data_parallel_size`` (the gradient reduction
    averages), so each rank's backward carries values that many times larger than one process's would. The scale
    starts at ``init_scale / data_parallel_size`` so that the product, and with it which steps overflow and are
    skipped, is the same on any number of processes (the scale then doubles and halves alike).
    """
    if not enabled:
        return None
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, init_scale=init_scale / data_parallel_size)
    return torch.amp.GradScaler(device.type, init_scale=init_scale / data_parallel_size)


def iterate_loader(loader: Iterable[T]) -> Iterator[T]:
    """``iter(loader)`` that leaves the global RNG as it was.

    A ``DataLoader`` draws its workers' base seed from the global RNG each time an iterator is made. A resumed run
    makes its iterator after restoring the RNG state of its checkpoint, where the uninterrupted run made its
    iterator before step 1: that one extra draw would shift every later random number (dropout masks), and
    validation, run or not, would shift them too. Nothing in our datasets is random per worker.
    """
    with torch.random.fork_rng(devices=[]):
        return iter(loader)


def global_batches(
    loader: Iterable[dict[str, torch.Tensor]], sampler: GlobalBatchSampler, *, accum_steps: int
) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
    """Yield ``(epoch, micro_batches)`` per optimizer step, endlessly, starting a new epoch when one runs out.

    The sampler gives each rank exactly ``accum_steps`` micro-batches of every global batch and drops an
    incomplete last one, so a step never straddles two epochs. The caller calls ``sampler.advance()`` after
    each optimizer step (the sampler's resumable position), not this generator.
    """
    epoch = sampler.epoch
    while True:
        micro_batches: list[dict[str, torch.Tensor]] = []
        for micro_batch in iterate_loader(loader):
            micro_batches.append(micro_batch)
            if len(micro_batches) == accum_steps:
                yield epoch, micro_batches
                micro_batches = []
        epoch += 1
        sampler.set_epoch(epoch)
