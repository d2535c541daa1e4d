"""A short supervised phase before RL, for a run that starts from a model too weak to ever earn a reward (the demo
starts from random weights): a few steps of the supervised loss on answered prompts, on the run's own layout."""

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from toolkit.data.sampler import GlobalBatchSampler
from toolkit.optim import cosine_with_warmup
from toolkit.parallel import ParallelDims
from toolkit.training.step import forward_backward, global_batches, optimizer_step


def supervised_warmup(
    model: nn.Module,
    dataset: Dataset,
    *,
    collate: Callable,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    lr: float,
    seed: int,
    dims: ParallelDims,
    data_parallel_group,
    device: torch.device,
    autocast=None,
    log: Callable[[str], None] = print,
) -> float:
    """Train ``model`` for ``steps`` steps of the token cross-entropy on ``dataset`` (global batches of
    ``batch_size`` rows, split over the data-parallel ranks as the recipes split theirs, so the result is the same on
    any layout), with AdamW (``lr`` after a linear warm-up of a tenth of the steps, then down a cosine to a tenth of
    it) and the gradient norm clipped to 1. Returns the last step's loss."""
    sampler = GlobalBatchSampler(len(dataset), global_batch_size=batch_size, rank=dims.batch_rank,
                                 world_size=dims.batch_ranks, seed=seed)
    per_rank = batch_size // dims.batch_ranks
    micro = min(micro_batch_size, per_rank)
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)
    schedule = cosine_with_warmup(optimizer, warmup_steps=max(steps // 10, 1), total_steps=steps, min_lr_ratio=0.1)
    model.train()
    loss = float("nan")
    batches = global_batches(loader, sampler, accum_steps=per_rank // micro)
    for step in range(1, steps + 1):
        _, micro_batches = next(batches)
        result = forward_backward(model, micro_batches, device=device, data_parallel_size=dims.dp_size,
                                  data_parallel_group=data_parallel_group, autocast=autocast)
        optimizer_step(model, optimizer, max_grad_norm=1.0)
        schedule.step()
        sampler.advance()
        loss = result.loss
        if step % max(steps // 5, 1) == 0 or step == steps:
            log(f"supervised warm-up step {step}/{steps}  loss {loss:.4f}")
    optimizer.zero_grad(set_to_none=True)
    return loss
