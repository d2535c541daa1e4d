"""Validation loss over a whole held-out set, exact on any number of processes.

The loss is the sum of token cross-entropies over every non-ignored label of the set divided by their count, both
summed over all ranks in float64: never a mean of per-batch or per-rank means, which would weight the tokens of
short batches more and change with the world size (see ``toolkit.training.accumulation``). Each rank reads a disjoint
slice of the set (:class:`ValidationSampler`) that together cover every sample exactly once, so the number is the
same on 1 or N processes up to float rounding.
"""

import contextlib
import math
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Sampler

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.errors import UserError
from toolkit.parallel.context_parallel import ContextParallel
from toolkit.training.attention_backend import split_for_attention
from toolkit.training.metrics import Progress
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.parallel import unwrap
from toolkit.training.step import iterate_loader
from toolkit.training.watchdog import progress


class SizedBatches(Protocol):
    """What :func:`validation_loss` reads: a ``DataLoader`` over a map-style dataset, or a list of batches."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]: ...


class ValidationSampler(Sampler[int]):
    """Rank ``r`` of ``W`` yields the contiguous block ``[r * N // W, (r + 1) * N // W)`` of ``range(N)``, in order.

    Every sample is read exactly once over all ranks: nothing is dropped and nothing is repeated to even out the
    ranks (as ``DistributedSampler`` does), since a repeated sample would count twice in the loss. Ranks thus
    hold at most one sample more than another, and may get different numbers of batches; :func:`validation_loss`
    keeps them in step.

    Args:
        num_samples: size of the validation set (``N``).
        rank: this process's data-parallel rank.
        world_size: number of data-parallel ranks (``W``).
    """

    def __init__(self, num_samples: int, *, rank: int = 0, world_size: int = 1) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.start = rank * num_samples // world_size
        self.stop = (rank + 1) * num_samples // world_size

    def __len__(self) -> int:
        return self.stop - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))


def free_gathered(model: nn.Module) -> None:
    """Free what FSDP2 keeps gathered after forwards that no backward follows (validation, a frozen model's
    scoring): the root's weights, and ZeRO-2's layers', which it otherwise holds until a backward."""
    for module in unwrap(model).modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def max_over_ranks(value: int, *, device: torch.device) -> int:
    if not dist.is_initialized():
        return value
    out = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return int(out.item())


def idle_batch(device: torch.device, *, rows: int = 1, length: int = 1) -> dict[str, torch.Tensor]:
    """``rows`` sequences of ``length`` tokens whose labels are ignored: what a rank out of held-out batches runs,
    scoring nothing, so that sharded layers' all-gathers stay in step with the ranks that still have batches (one
    token, or under context parallelism ``2 x cp``, the shortest row it splits)."""
    return {"tokens": torch.zeros((rows, length), dtype=torch.long, device=device),
            "labels": torch.full((rows, length), CROSS_ENTROPY_IGNORE_INDEX, dtype=torch.long, device=device)}


def batches_in_step(
    loader: SizedBatches, *, device: torch.device, idle: dict[str, torch.Tensor], label: str = "validation"
) -> Iterator[tuple[dict[str, torch.Tensor], bool]]:
    """``(batch, True)`` for each of this rank's batches (moved to ``device``), then ``(idle, False)`` until the
    rank with the most batches is done: every rank makes the same number of forwards. A collective (the count is
    agreed over all ranks); draws nothing from the training's RNG. Rank zero shows the pass's progress under
    ``label`` (:class:`~toolkit.training.metrics.Progress`: a bar on a terminal, a line now and then in a log)."""
    batches = iterate_loader(loader)
    steps = max_over_ranks(len(loader), device=device)
    rank_zero = not dist.is_initialized() or dist.get_rank() == 0
    with contextlib.closing(Progress(steps, label=label, unit="batches", enabled=rank_zero)) as shown:
        for _ in range(steps):
            batch = next(batches, None)
            if batch is None:
                yield idle, False
            else:
                yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}, True
            shown.update()


@contextlib.contextmanager
def scoring(*models: nn.Module) -> Iterator[None]:
    """Forwards without a backward (a held-out pass, a frozen model's scoring): ``models`` in eval mode, and on
    leaving, what FSDP2 kept gathered freed (:func:`free_gathered`) and each back in the mode it had."""
    plains = [unwrap(m) for m in models]
    modes = [p.training for p in plains]
    for p in plains:
        p.eval()
    try:
        yield
    finally:
        for p, mode in zip(plains, modes):
            free_gathered(p)
            p.train(mode)


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    loader: SizedBatches,
    *,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
    flex_attention: bool = False,
    loss_chunks: int | None = None,
    data_parallel_group: dist.ProcessGroup | None = None,
    context_parallel: ContextParallel | None = None,
) -> dict[str, float | int]:
    """Mean token cross-entropy of ``model`` over every batch of every rank's ``loader``.

    A collective: every rank calls it with its own slice of the set (a ``DataLoader`` over a
    :class:`ValidationSampler`). The model runs in eval mode and returns to its previous mode afterwards.

    A model sharded by FSDP2 all-gathers each layer's weights in every forward, so every rank must run the same
    number of forwards: a rank out of batches runs a one-token forward whose label is ignored until the rank
    with the most batches is done. A DDP model runs unwrapped (its forward would sync buffers, a collective).

    Args:
        model: a plain, DDP-wrapped or FSDP2-sharded decoder.
        loader: sized (``len``); batches of ``tokens``, shifted ``labels`` (ignored positions at
            ``CROSS_ENTROPY_IGNORE_INDEX``), optional ``mask`` and ``input_pos``, as ``padded_collate`` makes.
        device: where the model is.
        autocast: forward-pass context (mixed precision without FSDP2).
        flex_attention: attend with FlexAttention block masks, as in training.
        loss_chunks: project and score the positions in this many chunks, as in training, never holding a batch's
            logits (the decoder's ``labels=``).
        data_parallel_group: the ranks whose slices make up the set, over which the sums are taken (default: all;
            under tensor parallelism ``ParallelDims.dp_group``: the ranks of a TP group score the same slice).
        context_parallel: this rank's context-parallel group: the ranks of a group read the same slice, and each
            scores its part of every row (:meth:`~toolkit.parallel.context_parallel.ContextParallel.shard`).

    Returns:
        ``{"val_loss": sum / count, "val_perplexity": exp(val_loss), "val_tokens": count}`` over all ranks.

    Raises:
        UserError: the set has no non-ignored label on any rank.
    """
    plain = unwrap(model)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, token count]
    with scoring(plain):
        idle = idle_batch(device, length=1 if context_parallel is None else 2 * context_parallel.size)
        for batch, _ in batches_in_step(loader, device=device, idle=idle):
            progress("validation")
            with autocast or contextlib.nullcontext():
                batch, mask = split_for_attention(batch, flex_attention=flex_attention, context_parallel=context_parallel)
                loss_sum = plain(
                    batch["tokens"], mask=mask, input_pos=batch.get("input_pos"), labels=batch["labels"],
                    num_output_chunks=loss_chunks,
                )
            sums[0] += loss_sum.double()
            sums[1] += (batch["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum()
    loss_sum, count = all_reduce_sum(sums, group=data_parallel_group).tolist()
    if count == 0:
        raise UserError("validation: the dataset has no target tokens (every label is ignored); nothing to score")
    loss = loss_sum / count
    try:
        perplexity = math.exp(loss)
    except OverflowError:
        perplexity = math.inf
    return {"val_loss": loss, "val_perplexity": perplexity, "val_tokens": int(count)}
