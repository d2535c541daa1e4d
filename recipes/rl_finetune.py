"""Online RL with verifiable rewards: GRPO, Dr. GRPO, DAPO and GSPO; full fine-tuning or LoRA/DoRA/QLoRA.

    tune run rl_finetune_distributed --config demo                   # every local GPU (or 2 CPU processes)
    tune run rl_finetune_single_device --config demo loss=dr_grpo
    tune run --nproc_per_node 8 rl_finetune_distributed --config qwen3_8b_lora_math

Each step takes ``batch_size`` prompts; for each, ``num_generations`` (G) completions are sampled from the policy
being trained, in these processes and on their layout (no second engine, no weight sync); a program scores them
(``rewards``: exact match, a math verifier, a format regex, a length penalty, or any function); each completion's
advantage is its reward against its group's; and the policy takes ``updates_per_rollout`` optimizer steps on the
clipped objective ``loss`` (:mod:`toolkit.objectives.rl`). The loss is normalized over the global batch, whatever the
split into processes and micro-steps, and each completion's sampling is seeded by (seed, step, prompt, sample), never
by rank: 1, 2 or 8 processes, replicated, sharded or tensor-parallel, sample the same completions and train the same
weights. ``micro_batch_size`` counts prompts: a micro-step trains their G completions each.

A run that starts from a model too weak to earn any reward (the demo: random weights) can first take
``sft_warmup_steps`` supervised steps on ``sft_warmup_dataset``; the result is written to ``output_dir/sft_warmup``.
Held-out prompts (``validation_dataset``) are answered greedily and scored by the rewards before, during and after.
"""

import contextlib
import math
import time
from functools import partial

import torch
from omegaconf import DictConfig

from toolkit.checkpoint.peft import fill_adapter_model, save_adapter_and_merged
from toolkit.config import instantiate, recipe_main
from toolkit.data import padded_collate, rl_collate
from toolkit.errors import UserError
from toolkit.modules.moe import MoEFeedForward, record_routing
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.objectives.preference import frozen_reference, lora_reference, model_reference
from toolkit.objectives.rl import RLSettings, normalizer, rl_forward_backward, score_batches
from toolkit.parallel import barrier, destroy_distributed, unwrap
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.planning import StepKernels
from toolkit.recipe_setup import (
    build_data,
    parallelize_model,
    plan_layout,
    print_header,
    print_summary,
    row_padding,
    setup_run,
    start_training,
)
from toolkit.rl import RL_SCHEMA, RewardSet, SamplingSettings, check_prompts, clip_range, rl_kernels, verifier_index
from toolkit.rl.collect import (
    global_counts,
    record_rollouts,
    reward_validation,
    rollout_metrics,
    sample_groups,
    training_batches,
    truncate_rollouts,
)
from toolkit.rl.warmup import supervised_warmup
from toolkit.training import init_weights, optimizer_step, sdpa_preference, set_seed
from toolkit.training.watchdog import rank_watchdog

SCHEMA = RL_SCHEMA  # the shared training vocabulary and RL's own keys (toolkit/rl/keys.py), checked before launch


def train(cfg: DictConfig) -> None:
    # --- Processes, devices and precision; the checkpoint to resume from, or None (nothing is written yet) ---------
    run = setup_run(cfg)
    env = run.env
    clip_low, clip_high = clip_range(cfg.loss, cfg.get("clip_low"), cfg.get("clip_high"))
    rl = RLSettings(loss=cfg.loss, clip_low=clip_low, clip_high=clip_high, kl_coef=cfg.get("kl_coef") or 0.0,
                    max_new_tokens=cfg.max_new_tokens)
    G = cfg.num_generations

    # --- Policy: built on the meta device, then split over the mesh, materialized and loaded ------------------------
    set_seed(cfg.seed)
    build = partial(instantiate, cfg.model)
    with torch.device("meta"):
        model = build()
    if not hasattr(model, "setup_caches"):
        raise UserError("model: rollouts sample with the KV caches of the toolkit's own model families, which the "
                        "transformers backend does not have; use the family's builder")
    adapters = get_adapter_params(model)
    if adapters:
        set_trainable_params(model, adapters)
    # The memory plan counts a micro-step's G sequences per prompt, the KV cache of its rollouts, and a frozen copy
    # for a full fine-tune's KL reference.
    kernels = rl_kernels(StepKernels(loss_chunks=cfg.get("loss_chunks")), num_generations=G,
                         reference=bool(rl.kl_coef) and not adapters)
    replay = cfg.get("routing_replay", False)  # MoE: the updates route as the old log-probabilities' pass did
    if replay and not any(isinstance(m, MoEFeedForward) for m in model.modules()):
        raise UserError("routing_replay: the model has no mixture-of-experts layers to replay; remove it")
    layout = plan_layout(cfg, run=run, model=model, kernels=kernels)
    dims = layout.dims
    checkpointer = instantiate(cfg.checkpointer)

    def fill_base(module: torch.nn.Module) -> None:  # the starting weights: the base checkpoint, or random by seed
        if checkpointer.checkpoint_dir is not None:
            checkpointer.load(module)
        else:
            with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
                set_seed(cfg.seed)
                init_weights(module)

    if adapters:
        fill = partial(fill_adapter_model, checkpointer=checkpointer)
    else:
        fill = fill_base if run.resume is None else (lambda module: None)
    model = parallelize_model(cfg, model, run=run, layout=layout, fill=fill, compile=cfg.get("compile", False))

    # --- Prompts, rewards and sampling -------------------------------------------------------------------------------
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    sampling = SamplingSettings(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.get("top_k"), top_p=cfg.get("top_p"),
        stop_tokens=tuple(cfg.get("stop_tokens") or tokenizer.stop_tokens))
    check_prompts(dataset, key="dataset", max_prompt_tokens=cfg.max_seq_len - cfg.max_new_tokens)
    val_dataset = val_rows = None
    if cfg.get("validation_dataset"):
        val_dataset = instantiate(cfg.validation_dataset, tokenizer)
        check_prompts(val_dataset, key="validation_dataset", max_prompt_tokens=cfg.max_seq_len - cfg.max_new_tokens)
        val_rows = [val_dataset[i] for i in range(len(val_dataset))]
    rewards = RewardSet.from_config(cfg.rewards, key="rewards")
    verifier = verifier_index(rewards)
    data = build_data(cfg, layout=layout, dataset=dataset, collate=rl_collate, validation_dataset=val_dataset)
    sft_steps = cfg.get("sft_warmup_steps") or 0
    if sft_steps and run.resume is None:
        sft_dataset = instantiate(cfg.get("sft_warmup_dataset"), tokenizer)
    reference = None  # the KL's: the base with the adapters off, or a frozen copy of the starting weights
    if rl.kl_coef and adapters:
        reference = lora_reference(model)

    def validate() -> dict:
        return reward_validation(
            model, val_rows, rewards=rewards, verifier=verifier, tokenizer=tokenizer, settings=sampling,
            cache_len=cfg.max_seq_len, batch_size=layout.plan.micro_batch_size * G, rank=dims.batch_rank,
            num_ranks=dims.batch_ranks, group=layout.dp_group, device=env.device, show_progress=env.is_rank_zero)

    # --- Optimizer, schedule, step checkpoints, then the output folder ----------------------------------------------
    loop = start_training(cfg, recipe="rl_finetune", run=run, layout=layout, model=model, data=data,
                          base_checkpoint=checkpointer.checkpoint_dir, trainable_only=bool(adapters),
                          validate=validate if val_rows else None, tokenizer=tokenizer,
                          eval_tasks=instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None)
    log = loop.log
    n_params = sum(p.numel() for p in unwrap(model).parameters())
    print_header(log, f"{rl.loss} with G={G}, {len(rewards.names)} reward(s) ({', '.join(rewards.names)}); "
                 f"{n_params / 1e6:.2f}M parameters", run=run, layout=layout, data=data, batch_size=cfg.batch_size,
                 batch_unit="prompts", loop=loop)

    # --- A weak start: supervised warm-up (a fresh start only), written to output_dir/sft_warmup ---------------------
    warm = run.output_dir / "sft_warmup"
    if sft_steps and run.resume is None:
        collate = partial(padded_collate, pad_id=tokenizer.pad_id, attention_mask=False,
                          **row_padding(cfg, layout=layout))
        supervised_warmup(
            model, sft_dataset, collate=collate, steps=sft_steps, batch_size=cfg.get("sft_warmup_batch_size"),
            micro_batch_size=layout.plan.micro_batch_size * G, lr=cfg.get("sft_warmup_lr"), seed=cfg.seed, dims=dims,
            data_parallel_group=layout.dp_group, device=env.device, autocast=layout.autocast, log=log.print)
        log.print(f"saved the warm-up model to {checkpointer.export(model, warm)}")
    if rl.kl_coef and not adapters:  # the starting point: the warm-up's result, else the base checkpoint
        start = instantiate(cfg.checkpointer, checkpoint_dir=str(warm)) if sft_steps else checkpointer
        reference = model_reference(frozen_reference(
            build, dims=dims, mesh=layout.mesh, device=env.device, dtype=run.precision.compute_dtype,
            fill=start.load if start.checkpoint_dir is not None else fill_base))
    if val_rows and not loop.resumed:
        before = loop.validation()
        log.print(f"held-out {_score(before)} before RL ({before['val_prompts']} prompts)")

    # --- Training loop: sample, score, then update the policy on its own samples -------------------------------------
    rollouts_file = run.output_dir / "rollouts.jsonl"  # with save_rollouts: every completion, its tokens and reward
    if cfg.get("save_rollouts") and env.is_rank_zero:
        truncate_rollouts(rollouts_file, step=loop.step)
    batches = loop.global_batches()
    for epoch, micro_batches in batches:
        started = time.perf_counter()
        groups, generated = [], 0
        for rows in micro_batches:  # one batch of rollouts per micro-step's prompts
            found, tokens = sample_groups(model, rows, rewards=rewards, tokenizer=tokenizer, settings=sampling,
                                          num_generations=G, seed=cfg.seed, step=loop.step, cache_len=cfg.max_seq_len)
            groups += found
            generated += tokens
        generation_s = time.perf_counter() - started
        if cfg.get("save_rollouts"):
            record_rollouts(rollouts_file, groups, step=loop.step + 1, tokenizer=tokenizer, group=layout.dp_group,
                            write=env.is_rank_zero)
        metrics = rollout_metrics(groups, names=rewards.names, verifier=verifier, generated_tokens=generated,
                                  generation_s=generation_s, group=layout.dp_group, device=env.device)
        if cfg.get("dynamic_sampling"):  # DAPO: groups of equal rewards dropped, the batch refilled from next prompts
            groups, refills = _refill(groups, batches, loop=loop, cfg=cfg, rewards=rewards, tokenizer=tokenizer,
                                      sampling=sampling, group=layout.dp_group, device=env.device)
            metrics["refills"] = refills
        num_batches = _most_batches(len(groups), micro=layout.plan.micro_batch_size, group=layout.dp_group,
                                    device=env.device)
        rollouts = training_batches(groups, rl=rl, micro_batch_size=layout.plan.micro_batch_size,
                                    num_batches=num_batches, pad_id=tokenizer.pad_id,
                                    overlong_filter=cfg.get("overlong_filter", False))
        sequences, tokens = global_counts(rollouts, group=layout.dp_group, device=env.device)
        norm = normalizer(rl, num_sequences=sequences, num_tokens=tokens)
        if reference is not None:
            for batch, ref in zip(rollouts, score_batches(reference, rollouts, device=env.device,
                                                          autocast=layout.autocast)):
                batch.ref_logps = ref
        routing = None
        if cfg.updates_per_rollout > 1:  # the sampling policy's log-probabilities, by the training forward
            with record_routing(model) if replay else contextlib.nullcontext() as routing:  # (MoE: its experts)
                olds = score_batches(model, rollouts, device=env.device, autocast=layout.autocast)
            for batch, old in zip(rollouts, olds):
                batch.old_logps = old
        trained = time.perf_counter()
        for update in range(cfg.updates_per_rollout):
            result = rl_forward_backward(
                model, rollouts, settings=rl, norm=norm, device=env.device, data_parallel_size=dims.dp_size,
                data_parallel_group=layout.dp_group, autocast=layout.autocast, grad_scaler=loop.grad_scaler,
                num_output_chunks=cfg.get("loss_chunks") or 1, routing=routing)
            if update < cfg.updates_per_rollout - 1:  # (the last update is the loop's step, which logs it)
                optimizer_step(model, loop.state.optimizer, max_grad_norm=loop.max_grad_norm,
                               grad_scaler=loop.grad_scaler)
        result.metrics.update(metrics, generation_s=generation_s, training_tokens_per_second=tokens *
                              cfg.updates_per_rollout / max(time.perf_counter() - trained, 1e-9))
        loop.optimizer_step(result, epoch=epoch)
        loop.end_step()  # held-out rewards every eval_every_n_steps, a step checkpoint every save_every_n_steps

    # --- Evaluate and save: the model in Hugging Face format, or the PEFT adapter (and the merged model) ------------
    if val_rows:
        after = loop.final_validation()
        log.print(f"held-out {_score(after)} after RL ({after['val_prompts']} prompts)")
    loop.finish()
    if adapters:
        save_adapter_and_merged(model, checkpointer, output_dir=run.output_dir / "final",
                                save_merged=cfg.get("save_merged", False), build=build,
                                is_rank_zero=env.is_rank_zero, log=log.print)
    else:
        log.print(f"saved {checkpointer.export(model, run.output_dir / 'final')}")
    barrier()
    print_summary(loop, run=run, final=run.output_dir / "final")
    log.close()


def _score(metrics: dict) -> str:
    accuracy = f"accuracy {metrics['val_accuracy']:.1%}, " if "val_accuracy" in metrics else ""
    return f"{accuracy}reward {metrics['val_reward_mean']:.3f}"


def _most_batches(num_groups: int, *, micro: int, group, device) -> int:
    """The most micro-batches any data-parallel rank's groups make (every rank runs as many)."""
    mine = torch.tensor([math.ceil(num_groups / micro)], dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX, group=group)
    return max(int(mine.item()), 1)


def _refill(groups, batches, *, loop, cfg, rewards, tokenizer, sampling, group, device):
    """DAPO's dynamic sampling: keep the groups whose rewards differ; while the global batch holds fewer than
    ``batch_size`` of them, sample the next global batch of prompts too (at most ``max_refills`` times), which the
    data position counts. Returns the kept groups and the number of refills."""
    kept = [g for g in groups if g.informative]
    refills = 0
    while refills < cfg.get("max_refills", 3):
        total = int(all_reduce_sum(torch.tensor([len(kept)], dtype=torch.float64, device=device), group=group).item())
        if total >= cfg.batch_size:
            break
        try:
            _, more = next(batches)
        except StopIteration:
            break
        loop.state.sampler.advance()
        refills += 1
        for rows in more:
            found, _ = sample_groups(loop.state.model, rows, rewards=rewards, tokenizer=tokenizer, settings=sampling,
                                     num_generations=cfg.num_generations, seed=cfg.seed,
                                     step=loop.step, cache_len=cfg.max_seq_len)
            kept += [g for g in found if g.informative]
    return kept, refills


@recipe_main(schema=SCHEMA)
def main(cfg: DictConfig) -> None:
    try:
        with sdpa_preference(cfg.get("sdpa_backend")), rank_watchdog(cfg.output_dir, timeout_s=cfg.dist_timeout_s):
            train(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
