"""Knowledge distillation: a frozen teacher's next-token distributions taught to a student, full fine-tuning or
LoRA/DoRA, mixed with the student's own cross-entropy.

    tune run distill_single_device --config demo
    tune run distill_distributed --config demo                          # every local GPU (or CPU processes)

The teacher is any supported model with the student's tokenizer (the same vocabulary), loaded from
``teacher_checkpointer`` and laid out like the student: whole on every rank under ddp and zero1, sharded over the
same ranks under zero2, zero3 and hsdp (resharded after every forward), stored in the compute dtype. Per target
position the loss compares the two distributions softened by ``temperature`` (``kd_loss``: ``forward_kl``,
``reverse_kl`` or ``jsd``, see toolkit.modules.distillation), computed from both models' hidden states in chunks of
positions (``loss_chunks``), so neither model's logits exist whole. The step's loss is ``(1 - kd_ratio) *
cross-entropy + kd_ratio * divergence``, each the mean over the global batch's target tokens, whatever the split
into processes and micro-steps. Metrics per step: ``loss``, ``ce_loss``, ``kd_loss``; with a validation set, the
student's ``val_loss`` and ``val_kd_loss`` (its divergence from the teacher on held-out data).
"""

import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from toolkit.config import Bool, Choice, Component, Float, instantiate, recipe_main, rule
from toolkit.data import GlobalBatchSampler, padded_collate
from toolkit.errors import UserError
from toolkit.generation import report_exact_match
from toolkit.modules.distillation import DIVERGENCES
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.parallel import shard_optimizer_state, unwrap
from toolkit.training import (
    MetricsLogger,
    StepCheckpointer,
    StepKernels,
    TrainingState,
    ValidationSampler,
    barrier,
    claim_output_dir,
    destroy_distributed,
    fused_by_default,
    global_batches,
    init_distributed,
    init_weights,
    inject_fault,
    make_grad_scaler,
    on_rank_zero,
    optimizer_memory_model,
    optimizer_parameters,
    optimizer_step,
    parallelize,
    plan_parallelism,
    precision_policy,
    resolve_flex_attention,
    sdpa_preference,
    set_seed,
    start_run,
    step_metrics,
)
from toolkit.objectives.distillation import DistillSettings, check_teacher, distill_forward_backward, distill_validation
from toolkit.training.metric_loggers import build_metric_loggers_on_rank_zero
from toolkit.checkpoint.peft import fill_adapter_model, save_adapter_and_merged
from toolkit.objectives.preference import frozen_reference
from toolkit.training.watchdog import progress, rank_watchdog
from toolkit.training.recipe_keys import TRAINING_SCHEMA


@rule("kd_loss", "jsd_beta")
def jsd_beta_is_jsd_s(ctx):
    """Only the generalized JSD reads ``jsd_beta``: given with another divergence, it is refused, not ignored."""
    if ctx.get("jsd_beta") is not None and ctx.get("kd_loss") != "jsd":
        yield "jsd_beta", f"only kd_loss=jsd reads it, and kd_loss is {ctx.get('kd_loss')}; remove it"


# Every config key this recipe reads: the shared training vocabulary and distillation's own, checked whole before
# anything is built or written.
SCHEMA = TRAINING_SCHEMA.without(
    "fused_loss", "optimizer_in_backward", "activation_offloading", "float8", "profiler", "compile", "expert_parallel",
    "context_parallel", "context_parallel_method",
).extend(
    {
        "teacher_model": Component(),
        "teacher_checkpointer": Component(),
        "kd_loss": Choice(*DIVERGENCES),
        "kd_ratio": Float(ge=0, le=1),  # the divergence's share of the loss; the rest is the cross-entropy
        "temperature": Float(gt=0),
        "jsd_beta": Float(gt=0, lt=1, required=False),
        "save_merged": Bool(required=False),
    },
    rules=[jsd_beta_is_jsd_s],
)


def train(cfg: DictConfig) -> None:
    # --- Processes, devices and precision --------------------------------------------------------------------------
    env = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    precision = precision_policy(cfg.dtype, device=env.device)
    output_dir = Path(cfg.output_dir).expanduser()
    settings = DistillSettings(loss=cfg.kd_loss, kd_ratio=cfg.kd_ratio, temperature=cfg.temperature,
                               jsd_beta=cfg.get("jsd_beta", 0.5))
    base_checkpoint = cfg.checkpointer.get("checkpoint_dir")
    resume = on_rank_zero(
        start_run, output_dir, overwrite=cfg.overwrite, resume_from=cfg.resume_from, base_checkpoint=base_checkpoint
    )

    # --- Student and teacher: built on the meta device and checked against each other before anything is loaded ----
    set_seed(cfg.seed)
    with torch.device("meta"):
        model = instantiate(cfg.model)
        teacher_shape = instantiate(cfg.teacher_model)
    check_teacher(model, teacher_shape)
    adapters = get_adapter_params(model)
    if adapters:  # LoRA/DoRA: only the adapters train
        set_trainable_params(model, adapters)
    kernels = StepKernels(flex_attention=resolve_flex_attention(cfg.get("flex_attention", "auto"), env.device),
                          loss_chunks=cfg.get("loss_chunks"), frozen_model=teacher_shape)  # auto layouts count it
    plan = plan_parallelism(
        model=model, strategy=cfg.data_parallel, cpu_offload=cfg.cpu_offload, batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size, device=env.device, device_memory_gb=cfg.get("device_memory_gb"),
        world_size=env.world_size, local_world_size=env.local_world_size, max_seq_len=cfg.max_seq_len,
        dtype=cfg.dtype, activation_checkpointing=cfg.activation_checkpointing, kernels=kernels,
        shard_size=cfg.hsdp_shard_size, optimizer=optimizer_memory_model(cfg.optimizer._component_) or "adamw",
        tensor_parallel=cfg.get("tensor_parallel", 1), rank=env.rank,
    )
    dims = plan.dims  # the layout those degrees make
    mesh = dims.build_mesh(env.device.type)
    dp_group = dims.dp_group(mesh)
    checkpointer = instantiate(cfg.checkpointer)
    teacher_checkpointer = instantiate(cfg.teacher_checkpointer)
    if teacher_checkpointer.checkpoint_dir is None:
        raise UserError("teacher_checkpointer.checkpoint_dir: a teacher needs its trained weights; give its folder")

    def fill_student(module: torch.nn.Module) -> None:
        if adapters:
            fill_adapter_model(module, checkpointer)
        elif resume is None:  # (when resuming, every weight comes from the step checkpoint, loaded below)
            checkpointer.load(module) if checkpointer.checkpoint_dir is not None else init_weights(module)

    # Under tensor parallelism both models are split alike (their vocabularies too: the divergence is reduced over
    # the TP group, see toolkit.modules.distillation).
    sequence_parallel = cfg.get("sequence_parallel", False)
    model = parallelize(
        model, dims=dims, device=env.device, dtype=precision.param_dtype, fill=fill_student,
        mp_policy=precision.fsdp_policy(), activation_checkpointing=cfg.activation_checkpointing, mesh=mesh,
        sequence_parallel=sequence_parallel,
    )
    teacher = frozen_reference(partial(instantiate, cfg.teacher_model), dims=dims, mesh=mesh, device=env.device,
                               dtype=precision.compute_dtype, fill=teacher_checkpointer.load,
                               sequence_parallel=sequence_parallel)
    autocast = precision.autocast(env.device, sharded=dims.uses_fsdp)
    grad_scaler = make_grad_scaler(enabled=precision.needs_grad_scaler, device=env.device,
                                   sharded=dims.uses_fsdp or dims.tp > 1, data_parallel_size=dims.dp_size)

    # --- Data: every data-parallel rank reads its slice of each global batch ---------------------------------------
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    collate = partial(padded_collate, pad_id=tokenizer.pad_id, attention_mask=False, pack_to=cfg.max_seq_len)
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size=cfg.batch_size, rank=dims.dp_rank, world_size=dims.dp_size, seed=cfg.seed,
        shuffle=cfg.get("shuffle", True),
    )
    loader = DataLoader(dataset, batch_size=plan.micro_batch_size, sampler=sampler, collate_fn=collate)
    val_loader = None
    if cfg.get("validation_dataset"):
        val_dataset = instantiate(cfg.validation_dataset, tokenizer)
        val_loader = DataLoader(val_dataset, batch_size=plan.micro_batch_size, collate_fn=collate,
                                sampler=ValidationSampler(len(val_dataset), rank=dims.dp_rank, world_size=dims.dp_size))
    eval_tasks = instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None
    total_steps = cfg.epochs * sampler.steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    # --- Optimizer, schedule and step checkpoints (the student only; adapter runs keep only what trains) -----------
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = shard_optimizer_state(
        instantiate(fused_by_default(cfg.optimizer, grad_scaler=grad_scaler),
                    optimizer_parameters(model, cfg.optimizer)), dims=dims)
    lr_scheduler = instantiate(cfg.lr_scheduler, optimizer, total_steps=total_steps)
    state = TrainingState(model, optimizer, lr_scheduler, sampler, grad_scaler)
    checkpoints = StepCheckpointer(
        output_dir, every_n_steps=cfg.save_every_n_steps, keep_last_n=cfg.keep_last_n, async_save=cfg.async_save,
        trainable_only=bool(adapters), base_checkpoint=checkpointer.checkpoint_dir, data_parallel_size=dims.dp_size,
    )
    step = checkpoints.load(resume, state, config=cfg) if resume is not None else 0

    # --- The output folder: claimed once everything that can fail on the user's input is built and checked -------
    loggers = build_metric_loggers_on_rank_zero(cfg.get("metric_loggers") or [], output_dir=output_dir,
                                                initial_step=step)
    if resume is None:
        on_rank_zero(claim_output_dir, output_dir, overwrite=cfg.overwrite, base_checkpoint=base_checkpoint)
    log = MetricsLogger(output_dir, enabled=env.is_rank_zero, total_steps=total_steps, initial_step=step,
                        progress_bar=cfg.progress_bar, loggers=loggers, log_every_n_steps=cfg.log_every_n_steps)
    log.log_config(cfg)
    if env.is_rank_zero:
        OmegaConf.save(cfg, output_dir / "config.yaml")
    if resume is not None:
        log.print(f"resumed at step {step} from {resume}")
    n_student = sum(p.numel() for p in unwrap(model).parameters())
    n_teacher = sum(p.numel() for p in teacher_shape.parameters())
    log.print(
        f"{settings.loss} at temperature {settings.temperature}, kd_ratio {settings.kd_ratio}: a "
        f"{n_teacher / 1e6:.2f}M-parameter teacher into a {n_student / 1e6:.2f}M-parameter student "
        f"({sum(p.numel() for p in trainable) / 1e6:.3f}M trainable); {env.world_size} process(es) on "
        f"{env.device.type}, {dims.label}, {precision.name}; global batch {cfg.batch_size} = {dims.dp_size} x "
        f"{plan.micro_batch_size} x {plan.accumulation_steps} accumulation step(s); {total_steps} steps"
    )
    for reason in plan.reasons:
        log.print(reason)

    def validate() -> dict:
        return distill_validation(model, teacher, val_loader, settings=settings, device=env.device, autocast=autocast,
                                  flex_attention=kernels.flex_attention, num_output_chunks=kernels.loss_chunks,
                                  data_parallel_group=dp_group)

    validated = (None, None)  # the step of the last validation, and its metrics
    if resume is None and val_loader is not None:
        validated = (0, validate())
        log.log({"step": 0, **validated[1]})
        log.print(f"held-out divergence from the teacher before training: {validated[1]['val_kd_loss']:.4f}")
    if eval_tasks and resume is None:
        report_exact_match(model, tokenizer, eval_tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank,
                           world_size=env.world_size, when="before", log=log.print)

    # --- Training loop ------------------------------------------------------------------------------------------
    model.train()
    data_requested = time.perf_counter()
    for epoch, micro_batches in global_batches(loader, sampler, accum_steps=plan.accumulation_steps):
        if step == total_steps:
            break
        start = time.perf_counter()
        data_wait_s = start - data_requested
        result = distill_forward_backward(
            model, teacher, micro_batches, settings=settings, device=env.device, data_parallel_size=dims.dp_size,
            data_parallel_group=dp_group, autocast=autocast, grad_scaler=grad_scaler,
            num_output_chunks=kernels.loss_chunks, flex_attention=kernels.flex_attention,
        )
        forward_backward_s = time.perf_counter() - start
        grad_norm = optimizer_step(model, optimizer, max_grad_norm=cfg.clip_grad_norm, grad_scaler=grad_scaler)
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()
        sampler.advance()
        step += 1
        progress(f"step {step}")  # the watchdog's sign of life
        log.log(step_metrics(
            step=step, epoch=epoch, result=result, lr=lr, grad_norm=grad_norm, elapsed_s=time.perf_counter() - start,
            device=env.device, data_wait_s=data_wait_s, forward_backward_s=forward_backward_s,
            gather_rank_stats=step % cfg.log_every_n_steps == 0 or step == total_steps,
        ))
        if val_loader is not None and cfg.eval_every_n_steps and step % cfg.eval_every_n_steps == 0:
            validated = (step, validate())
            log.log({"step": step, **validated[1]})
        if checkpoints.due(step, total_steps):
            checkpoints.save(step, state, config=cfg, strategy=dims.strategy)
        inject_fault("after_step", step=step, rank=env.rank)  # a testing hook: see toolkit.training.debug
        data_requested = time.perf_counter()
    checkpoints.wait()

    # --- Evaluate and save: the student in Hugging Face format, or its PEFT adapter (and the merged model) ----------
    if val_loader is not None:
        if validated[0] != step:
            validated = (step, validate())
            log.log({"step": step, **validated[1]})
        log.print(f"held-out divergence from the teacher after training: {validated[1]['val_kd_loss']:.4f}")
    if eval_tasks:
        report_exact_match(model, tokenizer, eval_tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank,
                           world_size=env.world_size, when="after", log=log.print)
    if adapters:
        save_adapter_and_merged(model, checkpointer, output_dir=output_dir / "final",
                                save_merged=cfg.get("save_merged", False), build=partial(instantiate, cfg.model),
                                is_rank_zero=env.is_rank_zero, log=log.print)
    else:
        log.print(f"saved {checkpointer.export(model, output_dir / 'final')}")
    barrier()
    log.close()


@recipe_main(schema=SCHEMA)
def main(cfg: DictConfig) -> None:
    try:
        # A rank with no progress for dist_timeout_s leaves its stacks in output_dir/watchdog and ends the job
        # (toolkit.training.watchdog).
        with sdpa_preference(cfg.get("sdpa_backend")), rank_watchdog(cfg.output_dir, timeout_s=cfg.dist_timeout_s):
            train(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
