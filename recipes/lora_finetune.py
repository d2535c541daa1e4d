"""LoRA, DoRA and QLoRA fine-tuning: the base model is frozen and only low-rank adapters train.

One file for one device and for many, and for all three methods (chosen by the model builder's arguments:
``use_dora: true`` for DoRA, a ``qlora_*`` builder or ``quantize_base: true`` for QLoRA):

    tune run lora_finetune_single_device --config demo
    tune run lora_finetune_distributed --config demo                      # every local GPU (or CPU processes)
    tune run --nproc_per_node 8 lora_finetune_distributed --config llama3_1_8b_lora

Only the adapters' gradients are reduced across ranks (under DDP only trainable parameters are registered), and
the optimizer holds state only for them. The result is written as a PEFT adapter (``final/adapter``, loadable with
``peft.PeftModel.from_pretrained``) and, with ``save_merged: true``, as a merged Hugging Face model
(``final/merged``). Loss normalization, accumulation and data parallelism are the full fine-tune's (toolkit).
"""

import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from toolkit.config import Bool, instantiate, recipe_main
from toolkit.data import GlobalBatchSampler, padded_collate
from toolkit.generation import report_exact_match
from toolkit.training.watchdog import progress, rank_watchdog
from toolkit.training.recipe_keys import TRAINING_SCHEMA
from toolkit.modules.peft import get_adapter_params, set_trainable_params

from toolkit.training.metric_loggers import build_metric_loggers_on_rank_zero
from toolkit.checkpoint.peft import fill_adapter_model, save_adapter_and_merged
from toolkit.parallel import shard_optimizer_state, unwrap
from toolkit.training import (
    FLOAT8_TOKEN_MULTIPLE,
    MetricsLogger,
    OptimizerInBackward,
    StepCheckpointer,
    StepKernels,
    StepProfiler,
    TrainingState,
    ValidationSampler,
    apply_float8,
    barrier,
    check_float8_device,
    check_optimizer_in_backward,
    claim_output_dir,
    compile_model,
    destroy_distributed,
    flops_per_token,
    forward_backward,
    fused_by_default,
    global_batches,
    init_distributed,
    inject_fault,
    make_grad_scaler,
    measure_peak_flops,
    on_rank_zero,
    optimizer_memory_model,
    optimizer_parameters,
    optimizer_step,
    parallelize,
    plan_parallelism,
    precision_policy,
    profiler_settings,
    resolve_flex_attention,
    sdpa_preference,
    set_seed,
    start_run,
    static_lengths,
    step_metrics,
    validation_loss,
)


# Every config key this recipe reads, with its type, range and choices (the shared vocabulary, in
# toolkit/training/recipe_keys.py, and the adapters' own), checked whole before anything is built or written. The
# adapters' rank, alpha and dropout are checked by the LoRA builders' signatures.
SCHEMA = TRAINING_SCHEMA.extend({"save_merged": Bool()})

def train(cfg: DictConfig) -> None:
    # --- Processes, devices and precision --------------------------------------------------------------------------
    env = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    precision = precision_policy(cfg.dtype, device=env.device)
    output_dir = Path(cfg.output_dir).expanduser()
    profiler_options = profiler_settings(cfg.get("profiler"))  # a misspelled option stops here, before any output
    # The checkpoint to resume from (`resume_from`; after a restart by torchrun, the run's own newest), or None for
    # a fresh start. The folder is only checked here: nothing in it is cleared or written until the inputs are built.
    base_checkpoint = cfg.checkpointer.get("checkpoint_dir")  # never inside a folder that overwrite=true clears
    resume = on_rank_zero(
        start_run, output_dir, overwrite=cfg.overwrite, resume_from=cfg.resume_from, base_checkpoint=base_checkpoint
    )

    # --- Model: built on the meta device (no memory), then sharded or wrapped, materialized, initialized or loaded --
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights
    with torch.device("meta"):
        model = instantiate(cfg.model)
    # How the step computes attention and the loss (the plan counts their memory; the step runs them): FlexAttention
    # block masks for packed documents and soft-capped scores (auto: on CUDA; SDPA otherwise), the loss in chunks,
    # fused with the output projection.
    kernels = StepKernels(
        flex_attention=resolve_flex_attention(cfg.get("flex_attention", "auto"), env.device),
        loss_chunks=cfg.get("loss_chunks"),
        fused_loss=cfg.get("fused_loss", True),
    )
    # Only the adapters train: before the memory plan (which counts gradients and optimizer state for what trains)
    # and before wrapping (only adapters are reduced).
    set_trainable_params(model, get_adapter_params(model))
    # `tensor_parallel` ranks split each layer (toolkit.parallel.apply_tp); the data-parallel strategy, the batch
    # and the memory plan span the other dimension, world size / tensor_parallel ranks.
    # `auto` (tensor_parallel, data_parallel, micro_batch_size) is resolved from a memory estimate: the
    # least-communicating layout that fits the device (no TP, then TP within a node), then the largest micro batch
    # that fits; the global batch never changes.
    plan = plan_parallelism(
        model=model, strategy=cfg.data_parallel, cpu_offload=cfg.cpu_offload, batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size, device=env.device, device_memory_gb=cfg.get("device_memory_gb"),
        world_size=env.world_size, local_world_size=env.local_world_size, max_seq_len=cfg.max_seq_len,
        dtype=cfg.dtype, activation_checkpointing=cfg.activation_checkpointing,
        activation_offloading=cfg.activation_offloading, optimizer_in_backward=cfg.get("optimizer_in_backward", False),
        kernels=kernels, shard_size=cfg.hsdp_shard_size,
        optimizer=optimizer_memory_model(cfg.optimizer._component_) or "adamw",  # one it does not know: as AdamW
        tensor_parallel=cfg.get("tensor_parallel", 1),
        expert_parallel=cfg.get("expert_parallel", 1),  # experts shared out over data-parallel ranks (MoE models)
        context_parallel=cfg.get("context_parallel", 1),  # each sequence split over this many data-parallel ranks
        rank=env.rank,
    )
    accum_steps = plan.accumulation_steps
    # The layout those degrees make (the strategy, every degree, offloading): each degree is stated once, above.
    dims = plan.dims
    # The one device mesh (dp_replicate x dp_shard x tp) every dimension is cut from, and the data-parallel peers
    # of this rank, over which tokens and losses are summed (the ranks of a TP group share their micro-batches).
    mesh = dims.build_mesh(env.device.type)
    dp_group = dims.dp_group(mesh)
    # Context parallelism: the data-parallel ranks of a CP group read the same rows, each computing its positions of
    # them, and exchange keys and values (ring) or heads (alltoall) inside every attention layer.
    context_parallel = dims.context_parallel(env.device.type, cfg.get("context_parallel_method", "ring"))
    if cfg.get("optimizer_in_backward"):  # what it cannot do is refused here, before any weight is loaded
        check_optimizer_in_backward(
            dims=dims, micro_batch_size=plan.micro_batch_size, accumulation_steps=accum_steps,
            max_grad_norm=cfg.clip_grad_norm, grad_scaling=precision.needs_grad_scaler,
        )
    checkpointer = instantiate(cfg.checkpointer)

    # The base from the checkpoint (or random), adapters with B = 0: the model starts as exactly its base.
    fill = partial(fill_adapter_model, checkpointer=checkpointer)

    # float8 matmuls in the plain linear layers (torchao) and the LoRA layers' frozen bases, before compile and sharding
    if cfg.get("float8"):
        check_float8_device(env.device)
        float8_layers = apply_float8(model, fsdp_float8_all_gather=dims.is_sharded)
    # torch.compile per layer and for the fused loss's kernel (before parallelize, which wraps the compiled layers in
    # activation checkpointing and offloading).
    # Tensor-parallel layers compile for static shapes (torch 2.13 cannot trace DTensor layers for dynamic ones).
    if cfg.get("compile"):
        compile_model(model, device=env.device, dynamic=False if dims.tp > 1 else None)
    # Sharded strategies shard before allocating: each rank only ever holds (and loads) its shard of the base.
    model = parallelize(
        model, dims=dims, device=env.device, dtype=precision.param_dtype, fill=fill,
        mp_policy=precision.fsdp_policy(), activation_checkpointing=cfg.activation_checkpointing,
        activation_offloading=cfg.activation_offloading, mesh=mesh,
        sequence_parallel=cfg.get("sequence_parallel", False),
    )
    autocast = precision.autocast(env.device, sharded=dims.uses_fsdp)
    grad_scaler = make_grad_scaler(
        enabled=precision.needs_grad_scaler, device=env.device, sharded=dims.uses_fsdp or dims.tp > 1,
        data_parallel_size=dims.dp_size,  # fp16: the same steps overflow on any number of processes
    )

    # --- Data: every data-parallel rank reads its slice of each global batch, in an order independent of the layout -
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    # Masks are made on the device (FlexAttention's or SDPA's); packed batches all get the pack's shape.
    # Under sequence parallelism every batch's length is a multiple of the TP degree: each rank then holds its part;
    # compiled for static shapes, it is one of 8 lengths, each compiled once.
    # Under context parallelism every row is padded to a multiple of 2 x context_parallel, the chunks it is cut into.
    # With float8 each of those parts is a multiple of 16 long (CUDA's float8 matmuls of the weights' gradients).
    multiple = dims.row_multiple(sequence_parallel=cfg.get("sequence_parallel", False),
                                 part_multiple=FLOAT8_TOKEN_MULTIPLE if cfg.get("float8") else 1)
    collate = partial(padded_collate, pad_id=tokenizer.pad_id, attention_mask=False, pack_to=cfg.max_seq_len,
                      pad_to_multiple_of=multiple,
                      lengths=static_lengths(cfg.max_seq_len, multiple=multiple) if cfg.get("compile") and dims.tp > 1
                      else None)
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size=cfg.batch_size, rank=dims.batch_rank, world_size=dims.batch_ranks, seed=cfg.seed,
        shuffle=cfg.get("shuffle", True),  # false: the dataset's own order (curricula, comparing with another tool)
    )
    loader = DataLoader(
        dataset,
        batch_size=plan.micro_batch_size,
        sampler=sampler,
        collate_fn=collate,
    )
    # Validation: every rank scores a disjoint slice of the whole set; the loss is exact on any number of ranks.
    val_loader = None
    if cfg.get("validation_dataset"):
        val_dataset = instantiate(cfg.validation_dataset, tokenizer)
        val_loader = DataLoader(
            val_dataset,
            batch_size=plan.micro_batch_size,
            sampler=ValidationSampler(len(val_dataset), rank=dims.batch_rank, world_size=dims.batch_ranks),
            collate_fn=collate,
        )
    eval_tasks = instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None  # held-out accuracy, if set
    total_steps = cfg.epochs * sampler.steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    # --- Optimizer and schedule (after sharding: FSDP2 parameters are DTensors) ---------------------------------
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer_cfg = fused_by_default(cfg.optimizer, grad_scaler=grad_scaler)  # torch's Adam(W): fused when it can be
    if cfg.get("optimizer_in_backward"):  # one optimizer per parameter, stepped in backward; gradients freed at once
        optimizer = OptimizerInBackward(trainable, partial(instantiate, optimizer_cfg))
    else:
        optimizer = shard_optimizer_state(
            instantiate(optimizer_cfg, optimizer_parameters(model, optimizer_cfg)), dims=dims)
    lr_scheduler = instantiate(cfg.lr_scheduler, optimizer, total_steps=total_steps)

    # --- Step checkpoints hold only what trains (adapters, their optimizer state) and the resume state ------------
    state = TrainingState(model, optimizer, lr_scheduler, sampler, grad_scaler)
    checkpoints = StepCheckpointer(
        output_dir, every_n_steps=cfg.save_every_n_steps, keep_last_n=cfg.keep_last_n, async_save=cfg.async_save,
        trainable_only=True, base_checkpoint=checkpointer.checkpoint_dir, data_parallel_size=dims.dp_size,
    )
    step = checkpoints.load(resume, state, config=cfg) if resume is not None else 0

    # --- The output folder: claimed once everything that can fail on the user's input is built and checked -------
    # TensorBoard, W&B, MLflow, stdout, besides metrics.jsonl: built on rank zero now (packages imported, options and
    # the W&B login checked), they write nothing until their first record.
    loggers = build_metric_loggers_on_rank_zero(cfg.get("metric_loggers") or [], output_dir=output_dir,
                                                initial_step=step)
    # Only now is an old run in output_dir (overwrite=true) cleared; the checkpointer has also checked that every
    # node sees output_dir.
    if resume is None:
        on_rank_zero(claim_output_dir, output_dir, overwrite=cfg.overwrite, base_checkpoint=base_checkpoint)
    log = MetricsLogger(
        output_dir, enabled=env.is_rank_zero, total_steps=total_steps, initial_step=step, progress_bar=cfg.progress_bar,
        loggers=loggers,
        log_every_n_steps=cfg.log_every_n_steps,  # a loss line on the terminal every N steps
    )
    log.log_config(cfg)
    if env.is_rank_zero:
        OmegaConf.save(cfg, output_dir / "config.yaml")
    if resume is not None:
        log.print(f"resumed at step {step} from {resume}")
    n_params = sum(p.numel() for p in unwrap(model).parameters())
    n_trainable = sum(p.numel() for p in unwrap(model).parameters() if p.requires_grad)
    log.print(
        f"{n_params / 1e6:.2f}M parameters, {n_trainable / 1e6:.3f}M trainable; {env.world_size} process(es) on {env.device.type}, {dims.label}, "
        f"{precision.name}; global batch {cfg.batch_size} = {dims.batch_ranks} x {plan.micro_batch_size} x "
        f"{accum_steps} accumulation step(s); {total_steps} steps"
    )
    for reason in plan.reasons:
        log.print(reason)
    if cfg.get("float8"):
        log.print(f"float8 matmuls in {len(float8_layers)} layers")
    if eval_tasks and resume is None:
        report_exact_match(model, tokenizer, eval_tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank,
                           world_size=env.world_size, when="before", log=log.print)

    # --- Training loop ------------------------------------------------------------------------------------------
    # A torch.profiler trace of a window of steps (`profiler.enabled`), and on GPU the model FLOPs utilization.
    profiler = StepProfiler(output_dir, rank=env.rank, **profiler_options)
    flops = flops_per_token(unwrap(model), seq_len=cfg.max_seq_len)
    peak_flops = measure_peak_flops(env.device, precision.compute_dtype)
    model.train()
    data_requested = time.perf_counter()
    for epoch, micro_batches in global_batches(loader, sampler, accum_steps=accum_steps):
        if step == total_steps:
            break
        start = time.perf_counter()
        data_wait_s = start - data_requested  # reading and collating this step's micro-batches
        result = forward_backward(
            model, micro_batches, device=env.device, data_parallel_size=dims.dp_size, data_parallel_group=dp_group,
            autocast=autocast, grad_scaler=grad_scaler, num_output_chunks=kernels.loss_chunks,
            fused_loss=kernels.fused_loss, flex_attention=kernels.flex_attention, context_parallel=context_parallel,
        )
        forward_backward_s = time.perf_counter() - start
        grad_norm = optimizer_step(model, optimizer, max_grad_norm=cfg.clip_grad_norm, grad_scaler=grad_scaler)
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        sampler.advance()
        step += 1
        progress(f"step {step}")  # the watchdog's sign of life

        log.log(step_metrics(
            step=step, epoch=epoch, result=result, lr=lr, grad_norm=grad_norm,
            elapsed_s=time.perf_counter() - start, device=env.device,
            data_wait_s=data_wait_s, forward_backward_s=forward_backward_s,
            gather_rank_stats=step % cfg.log_every_n_steps == 0 or step == total_steps,
            flops_per_token=flops, peak_flops=peak_flops,
        ))
        profiler.step()
        if val_loader is not None and cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0:
            log.log({"step": step, **validation_loss(
                model, val_loader, device=env.device, autocast=autocast, flex_attention=kernels.flex_attention,
                loss_chunks=kernels.loss_chunks, data_parallel_group=dp_group,
                context_parallel=context_parallel,
            )})
        if checkpoints.due(step, total_steps):
            checkpoints.save(step, state, config=cfg, strategy=dims.strategy)
        inject_fault("after_step", step=step, rank=env.rank)  # a testing hook: see toolkit.training.debug
        data_requested = time.perf_counter()
    checkpoints.wait()
    profiler.close()

    # --- Evaluate and save ----------------------------------------------------------------------------------------
    if eval_tasks:
        report_exact_match(model, tokenizer, eval_tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank,
                           world_size=env.world_size, when="after", log=log.print)
    # The PEFT adapter (and, with save_merged, the merged model): see toolkit.checkpoint.peft.save_adapter_and_merged.
    save_adapter_and_merged(
        model, checkpointer, output_dir=output_dir / "final", save_merged=cfg.save_merged,
        build=partial(instantiate, cfg.model), is_rank_zero=env.is_rank_zero, log=log.print,
    )
    barrier()
    log.close()


@recipe_main(schema=SCHEMA)
def main(cfg: DictConfig) -> None:
    try:
        # SDPA's backend order, before anything is compiled; a rank with no progress for dist_timeout_s leaves
        # its stacks in output_dir/watchdog and ends the job (toolkit.training.watchdog).
        with sdpa_preference(cfg.get("sdpa_backend")), rank_watchdog(cfg.output_dir, timeout_s=cfg.dist_timeout_s):
            train(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
