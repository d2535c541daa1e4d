"""Full fine-tuning: every weight of the model is trained.

One file for one device and for many:

    tune run full_finetune_single_device --config demo
    tune run full_finetune_distributed --config demo                     # every local GPU (or CPU processes)
    tune run --nproc_per_node 8 full_finetune_distributed --config llama3_1_8b
    tune run --nnodes 2 --nproc_per_node 8 --rdzv_endpoint host:29500 full_finetune_distributed --config llama3_1_8b

It also runs directly (or under ``torchrun``), from the repository's root:

    python recipes/full_finetune.py --config recipe_configs/full_finetune/demo.yaml

Copy it with ``tune cp full_finetune my_recipe.py`` and edit freely.

The loss of an optimizer step is the mean over every trained token of the global batch (``batch_size``
sequences, split into ``micro_batch_size`` per device and accumulated), so the same global batch trains the same
model on any number of processes.

What every training recipe does alike (processes and precision, the memory plan and its mesh, the loaders, the
optimizer and schedule, step checkpoints and resuming, the output folder and metrics, the bookkeeping of a step)
is set up by :mod:`toolkit.recipe_setup`; this file keeps what makes it this recipe: its model, its loss, its loop.
"""

from functools import partial

import torch
from omegaconf import DictConfig

from toolkit.config import instantiate, recipe_main
from toolkit.data import padded_collate
from toolkit.parallel import destroy_distributed, unwrap
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
from toolkit.training import (
    FLOAT8_TOKEN_MULTIPLE,
    apply_float8,
    check_float8_device,
    forward_backward,
    init_weights,
    profiler_settings,
    resolve_flex_attention,
    sdpa_preference,
    set_seed,
    validation_loss,
)
from toolkit.training.recipe_keys import TRAINING_SCHEMA
from toolkit.training.watchdog import rank_watchdog

# Every config key this recipe reads, with its type, range and choices (the shared vocabulary, in
# toolkit/training/recipe_keys.py), and the rules between them: checked whole before anything is built or written.
SCHEMA = TRAINING_SCHEMA


def train(cfg: DictConfig) -> None:
    # --- Processes, devices and precision; the checkpoint to resume from, or None (nothing is written yet) ---------
    run = setup_run(cfg)
    env = run.env
    profiler_options = profiler_settings(cfg.get("profiler"))  # a misspelled option stops here, before any output

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
    # The layout: the data-parallel strategy over every rank, `tensor_parallel` ranks splitting each layer,
    # `expert_parallel` ranks sharing out the experts (MoE models), `context_parallel` ranks splitting each sequence
    # (ring: keys and values passed around; alltoall: heads). Each degree is stated once (this recipe's own here, the
    # shared ones in plan_layout), and the mesh is built from the plan; `auto` values are resolved from a memory
    # estimate (the least-communicating layout that fits, then the largest micro batch); the global batch is kept.
    layout = plan_layout(
        cfg, run=run, model=model, kernels=kernels, activation_offloading=cfg.activation_offloading,
        optimizer_in_backward=cfg.get("optimizer_in_backward", False), expert_parallel=cfg.get("expert_parallel", 1),
        context_parallel=cfg.get("context_parallel", 1),
        context_parallel_method=cfg.get("context_parallel_method", "ring"),
    )
    dims = layout.dims
    checkpointer = instantiate(cfg.checkpointer)

    def fill(model: torch.nn.Module) -> None:
        if run.resume is None:  # (when resuming, every weight comes from the step checkpoint, loaded below)
            checkpointer.load(model) if checkpointer.checkpoint_dir is not None else init_weights(model)

    if cfg.get("float8"):  # float8 matmuls in the linear layers (torchao), converted before compile and sharding
        check_float8_device(env.device)
        float8_layers = apply_float8(model, fsdp_float8_all_gather=dims.is_sharded)
    model = parallelize_model(cfg, model, run=run, layout=layout, fill=fill, compile=cfg.get("compile", False),
                              activation_offloading=cfg.activation_offloading)

    # --- Data: every data-parallel rank reads its slice of each global batch, in an order independent of the layout -
    tokenizer = instantiate(cfg.tokenizer)
    dataset = instantiate(cfg.dataset, tokenizer)
    # Masks are made on the device (FlexAttention's or SDPA's); packed batches all get the pack's shape. Rows are
    # padded to a multiple of the parts sequence or context parallelism cut them into (see row_padding), and with
    # float8 each part to a multiple of 16 tokens (CUDA's float8 matmuls of the weights' gradients).
    padding = row_padding(cfg, layout=layout, part_multiple=FLOAT8_TOKEN_MULTIPLE if cfg.get("float8") else 1)
    collate = partial(padded_collate, pad_id=tokenizer.pad_id, attention_mask=False, pack_to=cfg.max_seq_len,
                      **padding)
    data = build_data(cfg, layout=layout, dataset=dataset, collate=collate, tokenizer=tokenizer)
    eval_tasks = instantiate(cfg.eval_tasks) if cfg.get("eval_tasks") else None  # held-out accuracy, if set

    # --- Optimizer, schedule, step checkpoints (resume exactly where a run stopped), then the output folder -------
    loop = start_training(
        cfg, recipe="full_finetune", run=run, layout=layout, model=model, data=data,
        base_checkpoint=checkpointer.checkpoint_dir,
        optimizer_in_backward=cfg.get("optimizer_in_backward", False), profiler=profiler_options, measure_mfu=True,
        eval_tasks=eval_tasks, tokenizer=tokenizer,
        # The held-out loss: every rank scores a disjoint slice of the set; the loss is exact on any number of ranks.
        validate=partial(validation_loss, model, data.val_loader, device=env.device, autocast=layout.autocast,
                         flex_attention=kernels.flex_attention, loss_chunks=kernels.loss_chunks,
                         data_parallel_group=layout.dp_group, context_parallel=layout.context_parallel),
    )
    log = loop.log
    n_params = sum(p.numel() for p in unwrap(model).parameters())
    print_header(log, f"{n_params / 1e6:.2f}M parameters", run=run, layout=layout, data=data, batch_size=cfg.batch_size,
                 loop=loop, notes=[f"float8 matmuls in {len(float8_layers)} layers"] if cfg.get("float8") else ())

    # --- Training loop: with eval_tasks, their accuracy before (a fresh start) and after; on GPU the model FLOPs
    # utilization; a torch.profiler trace of a window of steps with `profiler.enabled`
    for epoch, micro_batches in loop.global_batches():
        result = forward_backward(
            model, micro_batches, device=env.device, data_parallel_size=dims.dp_size,
            data_parallel_group=layout.dp_group, autocast=layout.autocast, grad_scaler=loop.grad_scaler,
            num_output_chunks=kernels.loss_chunks, fused_loss=kernels.fused_loss,
            flex_attention=kernels.flex_attention, context_parallel=layout.context_parallel,
        )
        loop.optimizer_step(result, epoch=epoch)
        loop.end_step()  # the held-out loss every eval_every_n_steps, a step checkpoint every save_every_n_steps
    loop.finish()

    # --- Export: every rank writes its share of the Hugging Face files -----------------------------------------------
    final = checkpointer.export(model, run.output_dir / "final")
    log.print(f"saved {final}")
    print_summary(loop, run=run, final=final)  # wall time, best held-out loss, outputs, commands to try next
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
