"""Full fine-tuning: every weight of the model is trained.

One file for one device and for many:

    tune run full_finetune_single_device --config demo
    tune run full_finetune_distributed --config demo                     # every local GPU (or CPU processes)
    tune run --nproc_per_node 8 full_finetune_distributed --config llama3_1_8b
    tune run --nnodes 2 --nproc_per_node 8 --rdzv_endpoint host:29500 full_finetune_distributed --config ...

It also runs directly: ``python recipes/full_finetune.py --config recipe_configs/full_finetune/demo.yaml`` (or
under ``torchrun``). Copy it with ``tune cp full_finetune my_recipe.py`` and edit freely.

The loss of an optimizer step is the mean over every trained token of the global batch (``batch_size``
sequences, split into ``micro_batch_size`` per device and accumulated), so the same global batch trains the same
model on any number of processes.
"""

import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from toolkit.config import instantiate, recipe_main
from toolkit.data import GlobalBatchSampler, padded_collate
from toolkit.generation import exact_match_accuracy
from toolkit.training import (
    IGNORE_INDEX,
    MetricsLogger,
    all_reduce_sum,
    apply_ddp,
    barrier,
    cross_entropy_sum,
    destroy_distributed,
    global_token_count,
    gradient_accumulation_steps,
    gradient_scale,
    gradient_sync,
    init_distributed,
    init_weights,
    materialize,
    on_rank_zero,
    param_dtype,
    prepare_output_dir,
    set_seed,
    unwrap,
)


def evaluate(model, tokenizer, tasks, *, cfg: DictConfig, env, log: MetricsLogger, when: str) -> float:
    """Held-out exact-match accuracy, printed by rank zero."""
    correct, total = exact_match_accuracy(
        unwrap(model), tokenizer, tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank, world_size=env.world_size
    )
    log.print(f"held-out accuracy {when} training: {correct / total:.1%} ({correct}/{total})")
    return correct / total


def train(cfg: DictConfig) -> None:
    # --- Processes and devices -------------------------------------------------------------------------------
    env = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    accum_steps = gradient_accumulation_steps(
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size, world_size=env.world_size
    )
    output_dir = Path(cfg.output_dir)
    on_rank_zero(prepare_output_dir, output_dir, overwrite=cfg.overwrite)

    # --- Model: built on the meta device (no memory), materialized, then initialized or loaded ---------------
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights
    with torch.device("meta"):
        model = instantiate(cfg.model)
    materialize(model, device=env.device, dtype=param_dtype(cfg.dtype, device=env.device))
    checkpointer = instantiate(cfg.checkpointer)
    if checkpointer.checkpoint_dir is not None:
        checkpointer.load(model)
    else:
        init_weights(model)
    if env.is_distributed:
        model = apply_ddp(model, device=env.device)

    # --- Data: every rank reads its slice of each global batch, in an order independent of the world size ---
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size=cfg.batch_size, rank=env.rank, world_size=env.world_size, seed=cfg.seed
    )
    loader = DataLoader(
        dataset,
        batch_size=cfg.micro_batch_size,
        sampler=sampler,
        collate_fn=partial(padded_collate, pad_id=tokenizer.pad_id, ignore_index=IGNORE_INDEX),
    )
    total_steps = cfg.epochs * sampler.steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    # --- Optimizer and schedule ---------------------------------------------------------------------------------
    optimizer = instantiate(cfg.optimizer, [p for p in model.parameters() if p.requires_grad])
    lr_scheduler = instantiate(cfg.lr_scheduler, optimizer, total_steps=total_steps)

    log = MetricsLogger(output_dir, enabled=env.is_rank_zero, total_steps=total_steps, progress_bar=cfg.progress_bar)
    if env.is_rank_zero:
        OmegaConf.save(cfg, output_dir / "config.yaml")
    n_params = sum(p.numel() for p in model.parameters())
    log.print(
        f"{n_params / 1e6:.2f}M parameters on {env.world_size} process(es) ({env.device.type}); global batch "
        f"{cfg.batch_size} = {env.world_size} x {cfg.micro_batch_size} x {accum_steps} accumulation step(s); "
        f"{total_steps} steps"
    )
    eval_tasks = instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None
    if eval_tasks:
        evaluate(model, tokenizer, eval_tasks, cfg=cfg, env=env, log=log, when="before")

    # --- Training loop ------------------------------------------------------------------------------------------
    model.train()
    step, epoch = 0, 0
    batches = iter(loader)
    while step < total_steps:
        start = time.perf_counter()
        micro_batches = []
        while len(micro_batches) < accum_steps:
            try:
                micro_batches.append(next(batches))
            except StopIteration:  # the epoch is over: the next global batches come from a new permutation
                epoch += 1
                sampler.set_epoch(epoch)
                batches = iter(loader)
        # Count the global batch's trained tokens first, so each micro-batch adds exactly its share of the mean.
        num_tokens = global_token_count([mb["labels"] for mb in micro_batches])
        scale = gradient_scale(global_tokens=num_tokens, data_parallel_size=env.world_size)
        loss_sum = torch.zeros((), device=env.device)
        for i, mb in enumerate(micro_batches):
            mb = {k: v.to(env.device) for k, v in mb.items()}
            with gradient_sync(model, enabled=i == accum_steps - 1):
                # Packed batches carry a per-document attention mask and restarting positions.
                logits = model(mb["tokens"], mask=mb.get("mask"), input_pos=mb.get("input_pos"))
                micro_loss = cross_entropy_sum(logits, mb["labels"])
                (micro_loss * scale).backward()
            loss_sum += micro_loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm or float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        sampler.advance()
        step += 1

        loss = all_reduce_sum(loss_sum).item() / num_tokens
        elapsed = time.perf_counter() - start
        log.log({
            "step": step, "epoch": epoch, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
            "num_tokens": num_tokens, "tokens_per_second": num_tokens / elapsed, "step_time_s": elapsed,
        })

    # --- Evaluate and save ----------------------------------------------------------------------------------------
    if eval_tasks:
        evaluate(model, tokenizer, eval_tasks, cfg=cfg, env=env, log=log, when="after")
    if env.is_rank_zero:
        final = checkpointer.save(unwrap(model), output_dir / "final")
        log.print(f"saved {final}")
    barrier()
    log.close()


@recipe_main
def main(cfg: DictConfig) -> None:
    try:
        train(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
