"""Preference tuning: DPO, IPO, SimPO and ORPO on chosen/rejected pairs, KTO on answers judged one at a time;
full fine-tuning or LoRA/DoRA/QLoRA.

One file for one device and for many, and for every method: the model builder decides (a ``lora_*`` or
``qlora_*`` builder trains adapters, a plain one every weight), ``preference_loss`` the objective:

    tune run preference_finetune_single_device --config demo
    tune run preference_finetune_distributed --config demo              # every local GPU (or CPU processes)
    tune run --nproc_per_node 8 preference_finetune_distributed --config llama3_1_8b_lora_dpo

The reference model of ``dpo`` and ``ipo`` is the starting point of the policy: for adapters, the base with the
adapters switched off (no second copy in memory); for full fine-tuning, a frozen copy laid out like the policy
(sharded over the same ranks). With ``precompute_reference: true`` its log-probabilities are computed once, before
the first step, kept beside the cached tokenized data (or in ``output_dir`` for a dataset built in memory) and
read again by any run on the same data and starting model, and no reference runs during training. ``simpo`` and
``orpo`` take none.

``kto`` reads answers labelled desirable or not (toolkit.data.kto_dataset; ``batch_size`` counts answers): each step
first scores every prompt of the global batch with another sample's answer, without grad, for its KL reference
point, then trains on the answers (toolkit.objectives.kto). Its held-out data are pairs, scored as DPO's.

Each micro-batch of ``b`` pairs is one forward of ``2b`` rows (chosen, then rejected) that returns each row's summed
log-probability from the fused projection-and-loss path (no logits kept); the loss of a step is the mean over
every pair of the global batch (``batch_size`` pairs), whatever the split into processes and micro-steps, so the
same global batch trains the same model on any layout. Metrics per step: ``rewards_chosen``, ``rewards_rejected``,
``reward_margin``, ``reward_accuracy``, ``logps_chosen``, ``logps_rejected`` (see toolkit.objectives.preference).
"""

import json
import time
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from toolkit.config import Bool, Choice, Float, instantiate, recipe_main, rule
from toolkit.data import GlobalBatchSampler, kto_collate, preference_collate
from toolkit.errors import UserError
from toolkit.generation import report_exact_match
from toolkit.modules.peft import get_adapter_params, set_trainable_params, trained_routers
from toolkit.parallel import shard_optimizer_state, unwrap
from toolkit.training import (
    MetricsLogger,
    StepCheckpointer,
    StepKernels,
    TrainingState,
    ValidationSampler,
    barrier,
    claim_output_dir,
    compile_model,
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
    static_lengths,
    step_metrics,
)
from toolkit.objectives.kto import check_kto_balance, kto_forward_backward
from toolkit.training.metric_loggers import build_metric_loggers_on_rank_zero
from toolkit.checkpoint.peft import fill_adapter_model, save_adapter_and_merged
from toolkit.objectives.preference import (
    LOSSES,
    reference_logps_file,
    PreferenceSettings,
    WithReferenceLogps,
    frozen_reference,
    load_reference_logps,
    lora_reference,
    model_reference,
    precompute_reference_logps,
    preference_kernels,
    preference_forward_backward,
    preference_validation,
    save_reference_logps,
)
from toolkit.training.watchdog import progress, rank_watchdog
from toolkit.training.recipe_keys import TRAINING_SCHEMA


@rule("preference_loss", "precompute_reference", "label_smoothing", "desirable_weight", "undesirable_weight")
def preference_options_fit_the_loss(ctx):
    """What only some losses read, refused with the others rather than silently unused."""
    loss = ctx.get("preference_loss")
    if ctx.get("precompute_reference") and not PreferenceSettings(loss=loss).needs_reference:
        yield "precompute_reference", f"{loss} takes no reference model; remove precompute_reference or use dpo/ipo/kto"
    if ctx.get("label_smoothing", 0.0) and loss != "dpo":
        yield "label_smoothing", f"only dpo smooths its labels, and preference_loss is {loss}; remove it"
    for key in ("desirable_weight", "undesirable_weight"):
        if ctx.get(key) is not None and loss != "kto":
            yield key, f"only kto weighs its answers, and preference_loss is {loss}; remove it"


# Every config key this recipe reads: the shared training vocabulary (toolkit/training/recipe_keys.py) and the
# preference objective's own, checked whole before anything is built or written.
SCHEMA = TRAINING_SCHEMA.without(
    "fused_loss", "optimizer_in_backward", "activation_offloading", "float8", "profiler", "context_parallel",
    "context_parallel_method",
).extend(
    {
        "preference_loss": Choice(*LOSSES),
        "beta": Float(gt=0),
        "label_smoothing": Float(ge=0, lt=0.5, required=False),  # dpo (conservative DPO)
        "simpo_gamma": Float(ge=0, required=False),  # simpo's target reward margin
        "desirable_weight": Float(gt=0, required=False),  # kto: lambda_D, the desirable answers' weight
        "undesirable_weight": Float(gt=0, required=False),  # kto: lambda_U
        "precompute_reference": Bool(required=False),
        "save_merged": Bool(required=False),  # adapters: also write the merged model
    },
    rules=[preference_options_fit_the_loss],
)


def check_pairs(dataset, key: str, *, unpaired: bool = False, note: str = "") -> None:
    """A dataset of pairs (``chosen_*`` and ``rejected_*``), or with ``unpaired`` (KTO's training data) of answers
    judged one at a time (``completion_*``, ``desirable``), or one line naming the config key (and ``note``)."""
    wanted, what, builder = (("completion", "answers labelled desirable or not", "a KTO dataset such as "
                              "toolkit.data.kto_dataset") if unpaired else
                             ("chosen", "chosen/rejected pairs", "a preference dataset such as "
                              "toolkit.data.preference_dataset"))
    if len(dataset) == 0 or f"{wanted}_tokens" not in dataset[0]:
        found = "is empty" if len(dataset) == 0 else f"yields no {what}"
        raise UserError(f"{key}: the dataset {found}; give {builder}{note}")


def train(cfg: DictConfig) -> None:
    # --- Processes, devices and precision --------------------------------------------------------------------------
    env = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    precision = precision_policy(cfg.dtype, device=env.device)
    output_dir = Path(cfg.output_dir).expanduser()
    settings = PreferenceSettings(
        loss=cfg.preference_loss, beta=cfg.beta, label_smoothing=cfg.get("label_smoothing", 0.0),
        simpo_gamma=cfg.get("simpo_gamma", 0.5), desirable_weight=cfg.get("desirable_weight") or 1.0,
        undesirable_weight=cfg.get("undesirable_weight") or 1.0)
    kto = settings.loss == "kto"
    precompute = bool(cfg.get("precompute_reference")) and settings.needs_reference
    # The checkpoint to resume from (`resume_from`; after a restart by torchrun, the run's own newest), or None.
    base_checkpoint = cfg.checkpointer.get("checkpoint_dir")
    resume = on_rank_zero(
        start_run, output_dir, overwrite=cfg.overwrite, resume_from=cfg.resume_from, base_checkpoint=base_checkpoint
    )

    # --- Policy: built on the meta device, then split over the mesh, materialized and loaded ------------------------
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights
    build = partial(instantiate, cfg.model)
    with torch.device("meta"):
        model = build()
    adapters = get_adapter_params(model)
    if trained_routers(model):  # the reference is the policy with its adapters off, which keeps trained routers
        raise UserError("model.train_router: the LoRA reference model would route with the trained routers; set it "
                        "false, or train the routers with a full fine-tune")
    if adapters:  # LoRA/DoRA/QLoRA: only the adapters train
        set_trainable_params(model, adapters)
    # The memory plan counts a micro-batch of pairs as twice as many sequences, and a frozen reference copy if any.
    kernels = preference_kernels(
        StepKernels(flex_attention=resolve_flex_attention(cfg.get("flex_attention", "auto"), env.device),
                    loss_chunks=cfg.get("loss_chunks")),
        loss=settings.loss, adapters=bool(adapters), precompute=precompute,
    )
    plan = plan_parallelism(
        model=model, strategy=cfg.data_parallel, cpu_offload=cfg.cpu_offload, batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size, device=env.device, device_memory_gb=cfg.get("device_memory_gb"),
        world_size=env.world_size, local_world_size=env.local_world_size, max_seq_len=cfg.max_seq_len,
        dtype=cfg.dtype, activation_checkpointing=cfg.activation_checkpointing, kernels=kernels,
        shard_size=cfg.hsdp_shard_size, optimizer=optimizer_memory_model(cfg.optimizer._component_) or "adamw",
        tensor_parallel=cfg.get("tensor_parallel", 1), expert_parallel=cfg.get("expert_parallel", 1), rank=env.rank,
    )
    dims = plan.dims  # the layout those degrees make
    mesh = dims.build_mesh(env.device.type)
    dp_group = dims.dp_group(mesh)
    checkpointer = instantiate(cfg.checkpointer)

    def fill_base(module: torch.nn.Module) -> None:  # the starting weights: the base checkpoint, or random by seed
        if checkpointer.checkpoint_dir is not None:
            checkpointer.load(module)
        else:
            with torch.random.fork_rng(devices=[env.device] if env.device.type == "cuda" else []):
                set_seed(cfg.seed)  # the policy's own draws: the reference starts equal to it
                init_weights(module)

    if adapters:
        fill = partial(fill_adapter_model, checkpointer=checkpointer)
    else:  # when resuming, every weight comes from the step checkpoint, loaded below
        fill = fill_base if resume is None else (lambda module: None)
    sequence_parallel = cfg.get("sequence_parallel", False)
    if cfg.get("compile"):  # per layer, before parallelize; TP layers for static shapes (see full_finetune.py)
        compile_model(model, device=env.device, dynamic=False if dims.tp > 1 else None)
    model = parallelize(
        model, dims=dims, device=env.device, dtype=precision.param_dtype, fill=fill,
        mp_policy=precision.fsdp_policy(), activation_checkpointing=cfg.activation_checkpointing, mesh=mesh,
        sequence_parallel=sequence_parallel,
    )
    autocast = precision.autocast(env.device, sharded=dims.uses_fsdp)
    grad_scaler = make_grad_scaler(enabled=precision.needs_grad_scaler, device=env.device,
                                   sharded=dims.uses_fsdp or dims.tp > 1, data_parallel_size=dims.dp_size)

    # --- The reference: adapters off, a frozen copy, log-probabilities computed once, or none -----------------------
    reference = None
    if settings.needs_reference:
        if adapters:
            reference = lora_reference(model)
        elif not precompute or resume is None:  # (at a fresh start the policy is still its reference)
            reference = model_reference(unwrap(model)) if precompute else model_reference(frozen_reference(
                build, dims=dims, mesh=mesh, device=env.device, dtype=precision.compute_dtype, fill=fill_base,
                sequence_parallel=sequence_parallel))

    # --- Data: pairs; every data-parallel rank reads its slice of each global batch ------------------------------
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    check_pairs(dataset, "dataset", unpaired=kto)
    multiple = dims.row_multiple(sequence_parallel=sequence_parallel)
    val_collate = partial(preference_collate, pad_id=tokenizer.pad_id, pad_to_multiple_of=multiple,
                          lengths=static_lengths(cfg.max_seq_len, multiple=multiple)
                          if cfg.get("compile") and dims.tp > 1 else None)
    collate = partial(kto_collate, **val_collate.keywords) if kto else val_collate
    val_dataset = None
    if cfg.get("validation_dataset"):
        val_dataset = instantiate(cfg.validation_dataset, tokenizer)
        check_pairs(val_dataset, "validation_dataset", note=" (kto too is validated on held-out pairs)" if kto else "")
    eval_tasks = instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None
    if precompute:
        # Read back if computed from the same model, data and precision (beside the cached tokenized data, or in
        # output_dir); else computed now (never from a trained full fine-tune: then the file must be there).
        resolved = OmegaConf.to_container(cfg, resolve=True)
        sets = {"train": ("dataset", dataset, collate), **({"validation": (
            "validation_dataset", val_dataset, val_collate)} if val_dataset is not None else {})}
        fingerprints = {name: json.dumps({key: resolved.get(key) for key in (
            "model", "checkpointer", "dtype", "max_seq_len", data_key)}, sort_keys=True)
            for name, (data_key, *_) in sets.items()}
        files = {name: reference_logps_file(data, output_dir=output_dir, fingerprint=fingerprints[name])
                 for name, (_, data, _) in sets.items()}
        logps = {name: load_reference_logps(files[name], name=name, num_pairs=len(data),
                                            fingerprint=fingerprints[name]) for name, (_, data, _) in sets.items()}
        missing = [name for name, found in logps.items() if found is None]
        if missing and reference is None:
            raise UserError(f"resume_from: {files[missing[0]]} is missing or was computed for other data; a full "
                            "fine-tune cannot recompute its reference once trained: start afresh")
        for name in missing:
            logps[name] = precompute_reference_logps(
                reference, sets[name][1], sets[name][2], batch_size=plan.micro_batch_size, device=env.device,
                dp_rank=dims.dp_rank, dp_size=dims.dp_size, data_parallel_group=dp_group, autocast=autocast,
                flex_attention=kernels.flex_attention)
        dataset = WithReferenceLogps(dataset, logps["train"])
        if val_dataset is not None:
            val_dataset = WithReferenceLogps(val_dataset, logps["validation"])
        reference = None  # the batches carry it
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size=cfg.batch_size, rank=dims.dp_rank, world_size=dims.dp_size, seed=cfg.seed,
        shuffle=cfg.get("shuffle", True),
    )
    loader = DataLoader(dataset, batch_size=plan.micro_batch_size, sampler=sampler, collate_fn=collate)
    val_loader = None if val_dataset is None else DataLoader(
        val_dataset, batch_size=plan.micro_batch_size, collate_fn=val_collate,
        sampler=ValidationSampler(len(val_dataset), rank=dims.dp_rank, world_size=dims.dp_size),
    )
    total_steps = cfg.epochs * sampler.steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)

    # --- Optimizer, schedule and step checkpoints (adapter runs keep only what trains) ------------------------------
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
        for path in {files[name] for name in missing} if precompute else ():
            save_reference_logps(path, {name: logps[name] for name in files if files[name] == path},
                                 fingerprints=fingerprints)
    barrier()
    if resume is not None:
        log.print(f"resumed at step {step} from {resume}")
    n_params = sum(p.numel() for p in unwrap(model).parameters())
    n_trainable = sum(p.numel() for p in trainable)
    reference_kind = ("none" if not settings.needs_reference else "precomputed" if precompute
                      else "the base, adapters off" if adapters else "a frozen copy")
    log.print(
        f"{settings.loss} (beta {settings.beta}), reference: {reference_kind}; {n_params / 1e6:.2f}M parameters, "
        f"{n_trainable / 1e6:.3f}M trainable; {env.world_size} process(es) on {env.device.type}, {dims.label}, "
        f"{precision.name}; global batch {cfg.batch_size} {'answers' if kto else 'pairs'} = {dims.dp_size} x "
        f"{plan.micro_batch_size} x "
        f"{plan.accumulation_steps} accumulation step(s); {total_steps} steps"
    )
    for reason in plan.reasons:
        log.print(reason)
    if kto:
        unpaired = getattr(dataset, "dataset", dataset)  # (under its precomputed reference)
        log.print(f"kto: {unpaired.num_desirable} desirable and {len(unpaired) - unpaired.num_desirable} undesirable "
                  f"answers (weights {settings.desirable_weight} and {settings.undesirable_weight})")
        if advice := check_kto_balance(unpaired.num_desirable, len(unpaired) - unpaired.num_desirable,
                                       desirable_weight=settings.desirable_weight,
                                       undesirable_weight=settings.undesirable_weight):
            log.print(advice)
    for name in files if precompute else ():
        how = "computed into" if name in missing else "read from"
        log.print(f"reference log-probabilities of the {name} pairs {how} {files[name]}")

    def validate() -> dict:
        return preference_validation(model, val_loader, settings=settings, device=env.device, reference=reference,
                                     autocast=autocast, flex_attention=kernels.flex_attention,
                                     data_parallel_group=dp_group)

    if resume is None and val_loader is not None:
        before = validate()
        log.log({"step": 0, **before})
        log.print(f"held-out preference accuracy before training: {before['val_reward_accuracy']:.1%} "
                  f"({before['val_pairs']} pairs)")
    if eval_tasks and resume is None:
        report_exact_match(model, tokenizer, eval_tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank,
                           world_size=env.world_size, when="before", log=log.print)

    # --- Training loop ------------------------------------------------------------------------------------------
    validated = (None, None)  # the step of the last validation, and its metrics
    model.train()
    data_requested = time.perf_counter()
    for epoch, micro_batches in global_batches(loader, sampler, accum_steps=plan.accumulation_steps):
        if step == total_steps:
            break
        start = time.perf_counter()
        data_wait_s = start - data_requested
        result = (kto_forward_backward if kto else preference_forward_backward)(
            model, micro_batches, settings=settings, device=env.device, data_parallel_size=dims.dp_size,
            data_parallel_group=dp_group, reference=reference, autocast=autocast, grad_scaler=grad_scaler,
            flex_attention=kernels.flex_attention,
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

    # --- Evaluate and save: the model in Hugging Face format, or the PEFT adapter (and the merged model) -----------
    if val_loader is not None:
        if validated[0] != step:  # (not validated at the last step already)
            validated = (step, validate())
            log.log({"step": step, **validated[1]})
        after = validated[1]
        log.print(f"held-out preference accuracy after training: {after['val_reward_accuracy']:.1%} "
                  f"({after['val_pairs']} pairs)")
    if eval_tasks:
        report_exact_match(model, tokenizer, eval_tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=env.rank,
                           world_size=env.world_size, when="after", log=log.print)
    if adapters:
        save_adapter_and_merged(model, checkpointer, output_dir=output_dir / "final",
                                save_merged=cfg.get("save_merged", False), build=build,
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
