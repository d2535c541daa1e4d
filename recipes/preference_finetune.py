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
from functools import partial

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.checkpoint.peft import fill_adapter_model, save_adapter_and_merged
from toolkit.config import Bool, Choice, Float, instantiate, recipe_main, rule
from toolkit.data import kto_collate, preference_collate
from toolkit.errors import UserError
from toolkit.modules.peft import get_adapter_params, set_trainable_params, trained_routers
from toolkit.objectives.kto import check_kto_balance, kto_forward_backward
from toolkit.objectives.preference import (
    LOSSES,
    PreferenceSettings,
    WithReferenceLogps,
    frozen_reference,
    load_reference_logps,
    lora_reference,
    model_reference,
    precompute_reference_logps,
    preference_forward_backward,
    preference_kernels,
    preference_validation,
    reference_logps_file,
    save_reference_logps,
)
from toolkit.parallel import barrier, destroy_distributed, unwrap
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
from toolkit.training import init_weights, resolve_flex_attention, sdpa_preference, set_seed
from toolkit.training.recipe_keys import TRAINING_SCHEMA
from toolkit.training.watchdog import rank_watchdog


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
    # --- Processes, devices and precision; the checkpoint to resume from, or None (nothing is written yet) ---------
    run = setup_run(cfg)
    env = run.env
    settings = PreferenceSettings(
        loss=cfg.preference_loss, beta=cfg.beta, label_smoothing=cfg.get("label_smoothing", 0.0),
        simpo_gamma=cfg.get("simpo_gamma", 0.5), desirable_weight=cfg.get("desirable_weight") or 1.0,
        undesirable_weight=cfg.get("undesirable_weight") or 1.0)
    kto = settings.loss == "kto"
    precompute = bool(cfg.get("precompute_reference")) and settings.needs_reference

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
    # The layout and its mesh (see full_finetune.py): of the recipe's own degrees, expert parallelism (no context
    # parallelism yet).
    layout = plan_layout(cfg, run=run, model=model, kernels=kernels, expert_parallel=cfg.get("expert_parallel", 1))
    dims = layout.dims
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
        fill = fill_base if run.resume is None else (lambda module: None)
    # Compiled per layer, before parallelize; TP layers for static shapes (see toolkit.recipe_setup.parallelize_model).
    model = parallelize_model(cfg, model, run=run, layout=layout, fill=fill, compile=cfg.get("compile", False))

    # --- The reference: adapters off, a frozen copy, log-probabilities computed once, or none -----------------------
    reference = None
    if settings.needs_reference:
        if adapters:
            reference = lora_reference(model)
        elif not precompute or run.resume is None:  # (at a fresh start the policy is still its reference)
            reference = model_reference(unwrap(model)) if precompute else model_reference(frozen_reference(
                build, dims=dims, mesh=layout.mesh, device=env.device, dtype=run.precision.compute_dtype,
                fill=fill_base, sequence_parallel=cfg.get("sequence_parallel", False)))

    # --- Data: pairs; every data-parallel rank reads its slice of each global batch ------------------------------
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    check_pairs(dataset, "dataset", unpaired=kto)
    val_collate = partial(preference_collate, pad_id=tokenizer.pad_id, **row_padding(cfg, layout=layout))
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
        files = {name: reference_logps_file(data, output_dir=run.output_dir, fingerprint=fingerprints[name])
                 for name, (_, data, _) in sets.items()}
        logps = {name: load_reference_logps(files[name], name=name, num_pairs=len(data),
                                            fingerprint=fingerprints[name]) for name, (_, data, _) in sets.items()}
        missing = [name for name, found in logps.items() if found is None]
        if missing and reference is None:
            raise UserError(f"resume_from: {files[missing[0]]} is missing or was computed for other data; a full "
                            "fine-tune cannot recompute its reference once trained: start afresh")
        for name in missing:
            logps[name] = precompute_reference_logps(
                reference, sets[name][1], sets[name][2], batch_size=layout.plan.micro_batch_size, device=env.device,
                dp_rank=dims.dp_rank, dp_size=dims.dp_size, data_parallel_group=layout.dp_group,
                autocast=layout.autocast, flex_attention=kernels.flex_attention)
        dataset = WithReferenceLogps(dataset, logps["train"])
        if val_dataset is not None:
            val_dataset = WithReferenceLogps(val_dataset, logps["validation"])
        reference = None  # the batches carry it
    data = build_data(cfg, layout=layout, dataset=dataset, collate=collate, validation_dataset=val_dataset,
                      val_collate=val_collate)

    # --- Optimizer, schedule, step checkpoints (adapter runs keep only what trains), then the output folder -------
    def validate() -> dict:
        return preference_validation(model, data.val_loader, settings=settings, device=env.device, reference=reference,
                                     autocast=layout.autocast, flex_attention=kernels.flex_attention,
                                     data_parallel_group=layout.dp_group)

    loop = start_training(
        cfg, recipe="preference_finetune", run=run, layout=layout, model=model, data=data,
        base_checkpoint=checkpointer.checkpoint_dir,
        trainable_only=bool(adapters), eval_tasks=eval_tasks, tokenizer=tokenizer, validate=validate,
    )
    log = loop.log
    if env.is_rank_zero:
        for path in {files[name] for name in missing} if precompute else ():
            save_reference_logps(path, {name: logps[name] for name in files if files[name] == path},
                                 fingerprints=fingerprints)
    barrier()
    n_params = sum(p.numel() for p in unwrap(model).parameters())
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reference_kind = ("none" if not settings.needs_reference else "precomputed" if precompute
                      else "the base, adapters off" if adapters else "a frozen copy")
    print_header(
        log, f"{settings.loss} (beta {settings.beta}), reference: {reference_kind}; {n_params / 1e6:.2f}M parameters, "
        f"{n_trainable / 1e6:.3f}M trainable", run=run, layout=layout, data=data, batch_size=cfg.batch_size,
        batch_unit="answers" if kto else "pairs", loop=loop,
    )
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
    if run.resume is None and data.val_loader is not None:
        before = loop.validation()
        log.print(f"held-out preference accuracy before training: {before['val_reward_accuracy']:.1%} "
                  f"({before['val_pairs']} pairs)")

    # --- Training loop (with eval_tasks: their accuracy before, on a fresh start, and after) ------------------------
    for epoch, micro_batches in loop.global_batches():
        result = (kto_forward_backward if kto else preference_forward_backward)(
            model, micro_batches, settings=settings, device=env.device, data_parallel_size=dims.dp_size,
            data_parallel_group=layout.dp_group, reference=reference, autocast=layout.autocast,
            grad_scaler=loop.grad_scaler, flex_attention=kernels.flex_attention,
        )
        loop.optimizer_step(result, epoch=epoch)
        loop.end_step()  # validation every eval_every_n_steps, a step checkpoint every save_every_n_steps

    # --- Evaluate and save: the model in Hugging Face format, or the PEFT adapter (and the merged model) -----------
    if data.val_loader is not None:
        after = loop.final_validation()
        log.print(f"held-out preference accuracy after training: {after['val_reward_accuracy']:.1%} "
                  f"({after['val_pairs']} pairs)")
    loop.finish()
    if adapters:
        save_adapter_and_merged(model, checkpointer, output_dir=run.output_dir / "final",
                                save_merged=cfg.get("save_merged", False), build=build,
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
