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

from functools import partial

import torch
from omegaconf import DictConfig

from toolkit.checkpoint.peft import fill_adapter_model, save_adapter_and_merged
from toolkit.config import Bool, Choice, Component, Float, instantiate, recipe_main, rule
from toolkit.data import padded_collate
from toolkit.errors import UserError
from toolkit.modules.distillation import DIVERGENCES
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.objectives.distillation import DistillSettings, check_teacher, distill_forward_backward, distill_validation
from toolkit.objectives.preference import frozen_reference
from toolkit.parallel import barrier, destroy_distributed, unwrap
from toolkit.planning import StepKernels
from toolkit.recipe_setup import (
    build_data,
    parallelize_model,
    plan_layout,
    print_header,
    print_summary,
    setup_run,
    start_training,
)
from toolkit.training import init_weights, resolve_flex_attention, sdpa_preference, set_seed
from toolkit.training.recipe_keys import TRAINING_SCHEMA
from toolkit.training.watchdog import rank_watchdog


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
    # --- Processes, devices and precision; the checkpoint to resume from, or None (nothing is written yet) ---------
    run = setup_run(cfg)
    env = run.env
    settings = DistillSettings(loss=cfg.kd_loss, kd_ratio=cfg.kd_ratio, temperature=cfg.temperature,
                               jsd_beta=cfg.get("jsd_beta", 0.5))

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
    # The layout and its mesh (see full_finetune.py): of the degrees, only the shared tensor_parallel (yet).
    layout = plan_layout(cfg, run=run, model=model, kernels=kernels)
    dims = layout.dims
    checkpointer = instantiate(cfg.checkpointer)
    teacher_checkpointer = instantiate(cfg.teacher_checkpointer)
    if teacher_checkpointer.checkpoint_dir is None:
        raise UserError("teacher_checkpointer.checkpoint_dir: a teacher needs its trained weights; give its folder")

    def fill_student(module: torch.nn.Module) -> None:
        if adapters:
            fill_adapter_model(module, checkpointer)
        elif run.resume is None:  # (when resuming, every weight comes from the step checkpoint, loaded below)
            checkpointer.load(module) if checkpointer.checkpoint_dir is not None else init_weights(module)

    # Under tensor parallelism both models are split alike (their vocabularies too: the divergence is reduced over
    # the TP group, see toolkit.modules.distillation).
    model = parallelize_model(cfg, model, run=run, layout=layout, fill=fill_student)
    teacher = frozen_reference(partial(instantiate, cfg.teacher_model), dims=dims, mesh=layout.mesh, device=env.device,
                               dtype=run.precision.compute_dtype, fill=teacher_checkpointer.load,
                               sequence_parallel=cfg.get("sequence_parallel", False))

    # --- Data: every data-parallel rank reads its slice of each global batch ---------------------------------------
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    collate = partial(padded_collate, pad_id=tokenizer.pad_id, attention_mask=False, pack_to=cfg.max_seq_len)
    data = build_data(cfg, layout=layout, dataset=dataset, collate=collate, tokenizer=tokenizer)
    eval_tasks = instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None

    # --- Optimizer, schedule, step checkpoints (the student only; adapter runs keep only what trains), output folder -
    def validate() -> dict:
        return distill_validation(model, teacher, data.val_loader, settings=settings, device=env.device,
                                  autocast=layout.autocast, flex_attention=kernels.flex_attention,
                                  num_output_chunks=kernels.loss_chunks, data_parallel_group=layout.dp_group)

    loop = start_training(
        cfg, recipe="distill", run=run, layout=layout, model=model, data=data,
        base_checkpoint=checkpointer.checkpoint_dir,
        trainable_only=bool(adapters), eval_tasks=eval_tasks, tokenizer=tokenizer, validate=validate,
    )
    log = loop.log
    n_student = sum(p.numel() for p in unwrap(model).parameters())
    n_teacher = sum(p.numel() for p in teacher_shape.parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print_header(
        log, f"{settings.loss} at temperature {settings.temperature}, kd_ratio {settings.kd_ratio}: a "
        f"{n_teacher / 1e6:.2f}M-parameter teacher into a {n_student / 1e6:.2f}M-parameter student "
        f"({n_trainable / 1e6:.3f}M trainable)", run=run, layout=layout, data=data, batch_size=cfg.batch_size,
        loop=loop,
    )
    if run.resume is None and data.val_loader is not None:
        before = loop.validation()
        log.print(f"held-out divergence from the teacher before training: {before['val_kd_loss']:.4f}")

    # --- Training loop (with eval_tasks: their accuracy before, on a fresh start, and after) ------------------------
    for epoch, micro_batches in loop.global_batches():
        result = distill_forward_backward(
            model, teacher, micro_batches, settings=settings, device=env.device, data_parallel_size=dims.dp_size,
            data_parallel_group=layout.dp_group, autocast=layout.autocast, grad_scaler=loop.grad_scaler,
            num_output_chunks=kernels.loss_chunks, flex_attention=kernels.flex_attention,
        )
        loop.optimizer_step(result, epoch=epoch)
        loop.end_step()  # validation every eval_every_n_steps, a step checkpoint every save_every_n_steps

    # --- Evaluate and save: the student in Hugging Face format, or its PEFT adapter (and the merged model) ----------
    if data.val_loader is not None:
        after = loop.final_validation()
        log.print(f"held-out divergence from the teacher after training: {after['val_kd_loss']:.4f}")
    loop.finish()
    if adapters:
        save_adapter_and_merged(model, checkpointer, output_dir=run.output_dir / "final",
                                save_merged=cfg.get("save_merged", False), build=partial(instantiate, cfg.model),
                                is_rank_zero=env.is_rank_zero, log=log.print)
    else:
        log.print(f"saved {checkpointer.export(model, run.output_dir / 'final')}")
    barrier()
    print_summary(loop, run=run, final=run.output_dir / "final")  # wall time, outputs, commands to try next
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
