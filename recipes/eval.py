"""Evaluate a checkpoint: perplexity on a dataset, exact-match accuracy on generation tasks, and optionally the
tasks of lm-evaluation-harness.

    tune run eval --config demo                                              # outputs/full_finetune_demo/final
    tune run eval --config demo checkpointer.checkpoint_dir=null             # a random model (from `seed`)
    tune run eval_distributed --nproc_per_node 2 --config demo data_parallel=zero3
    tune run eval_distributed --nproc_per_node 2 --config demo tensor_parallel=2
    tune run eval --config demo checkpointer.checkpoint_dir=null adapter_dir=outputs/lora_finetune_demo/final/adapter
    tune run eval --config demo 'lm_eval.tasks=[arc_easy]' lm_eval.limit=100   # pip install "tunekit[eval]"
    tune run eval --config any_model 'lm_eval.tasks=[gsm8k]' lm_eval.apply_chat_template=true  # a chat fine-tune

The base weights come from ``checkpointer.checkpoint_dir`` (a Hugging Face folder, or one of our step checkpoints;
``null``: random initialization from ``seed``, a baseline). With ``adapter_dir``, a PEFT LoRA/DoRA adapter folder
is loaded on top: a plain ``model`` is built as its LoRA/DoRA version with the targets, rank and alpha of the
adapter's ``adapter_config.json``; a LoRA builder in ``model`` is used as it is, and must match the adapter.

``dataset`` (if set) is scored by the mean token cross-entropy over all its target tokens (perplexity = its
exponential), the same on any number of processes up to float rounding. ``eval_tasks`` (if set, ``{"prompt",
"answer"}`` samples) is scored by greedy generation and exact match. ``lm_eval.tasks`` (if set) runs those tasks of
lm-evaluation-harness (the ``eval`` extra) on the model through ``toolkit.evaluation``: on several processes each
scores its share of the requests (under FSDP2, all processes generate every answer together), and the metrics are
the same as on one. With ``lm_eval.apply_chat_template``, its prompts are rendered in the tokenizer's chat format, as a
chat fine-tune was trained (``lm_eval.fewshot_as_multiturn``: few-shot examples as earlier turns;
``lm_eval.system_instruction``: a system message). A table is printed and the numbers are written to
``<output_dir>/eval.json``.

``tensor_parallel: N`` splits every layer over N processes (a model too large for one device); the
``data_parallel`` strategy then spans the world size / N groups, each scoring its share of the set.
"""

import json
import os
from functools import partial
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from toolkit.config import Choice, Component, Float, Int, Schema, Section, Str, instantiate, recipe_main
from toolkit.data import padded_collate
from toolkit.errors import UserError
from toolkit.evaluation import check_chat_settings, load_lm_eval_tasks, run_lm_eval
from toolkit.generation import exact_match_accuracy
from toolkit.modules.peft import adapter_modules
from toolkit.parallel import STRATEGIES, parallel_dims
from toolkit.training import (
    destroy_distributed,
    init_distributed,
    materialize,
    on_rank_zero,
    parallelize,
    precision_policy,
    resolve_flex_attention,
    sdpa_preference,
    set_seed,
)
from toolkit.checkpoint.output_dir import check_writable_folder
from toolkit.checkpoint.peft import adapter_linear, fill_adapter_model
from toolkit.training.recipe_keys import MODEL_KEYS, PARALLEL_KEYS, tensor_parallel_fits, parallelism_splits_the_model
from toolkit.training.validation import ValidationSampler, validation_loss

# Every config key this recipe reads, checked before anything is loaded (toolkit/training/recipe_keys.py has the shared
# ones).
SCHEMA = Schema({
    **MODEL_KEYS,
    **PARALLEL_KEYS,
    "data_parallel": Choice(*STRATEGIES),
    "output_dir": Str(),
    "adapter_dir": Str(null=True),
    "max_seq_len": Int(ge=1, null=True, required=False),
    "micro_batch_size": Int(ge=1),
    "dataset": Component(null=True, required=False),
    "eval_tasks": Component(null=True, required=False),
    "eval_max_new_tokens": Int(ge=1),
    "lm_eval": Section(null=True, required=False),
    "lm_eval.batch_size": Int(ge=1),
    "lm_eval.limit": Float(gt=0, null=True),
    "lm_eval.num_fewshot": Int(ge=0, null=True),
}, rules=(tensor_parallel_fits, parallelism_splits_the_model))


def write_report(results: dict, output_dir: Path) -> Path:
    """Write ``eval.json`` whole or not at all (a rename), and print the table."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / "eval.json"
    tmp = path.with_name(f".eval.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(path)
    rows = [("checkpoint", results["checkpoint_dir"] or f"random initialization (seed {results['seed']})")]
    if results["adapter_dir"]:
        rows.append(("adapter", results["adapter_dir"]))
    if "val_loss" in results:
        rows += [
            ("val_loss", f"{results['val_loss']:.4f}"),
            ("val_perplexity", f"{results['val_perplexity']:.3f}"),
            ("val_tokens", str(results["val_tokens"])),
        ]
    if "accuracy" in results:
        rows.append(("accuracy", f"{results['accuracy']:.1%} ({results['correct']}/{results['total']})"))
    for task, report in results.get("lm_eval", {}).items():
        metrics = report["metrics"]
        for name, value in metrics.items():
            metric, comma, filter_name = name.partition(",")  # acc, or exact_match,strict-match
            if metric.endswith("_stderr"):
                continue  # shown after its metric
            stderr = metrics.get(f"{metric}_stderr{comma}{filter_name}")
            rows.append((f"{task} {name}", f"{value:.4f}" + ("" if stderr is None else f" ± {stderr:.4f}")))
        rows.append((f"{task} samples", f"{report['samples']} ({report['num_fewshot']}-shot)"))
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows), flush=True)
    return path


def evaluate(cfg: DictConfig) -> None:
    # --- Processes, devices and precision --------------------------------------------------------------------------
    env = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    precision = precision_policy(cfg.dtype, device=env.device)
    # The report is written into output_dir at the end: a folder that cannot be written stops the run here instead.
    output_dir = Path(cfg.output_dir).expanduser()
    on_rank_zero(check_writable_folder, output_dir)
    dims = parallel_dims(
        strategy=cfg.data_parallel, world_size=env.world_size, local_world_size=env.local_world_size,
        shard_size=cfg.hsdp_shard_size, device_type=env.device.type, tensor_parallel=cfg.get("tensor_parallel", 1),
        rank=env.rank,
    )
    # lm-evaluation-harness is looked up before the model loads: a missing package or task name, or a chat template
    # the tokenizer does not have, fails at once.
    harness = cfg.get("lm_eval") or {}
    lm_eval_tasks = None
    if harness.get("tasks"):
        untruncated = instantiate(cfg.tokenizer, max_seq_len=None)  # the adapter cuts sequences from the left
        chat_settings = {
            "apply_chat_template": harness.get("apply_chat_template", False),
            "fewshot_as_multiturn": harness.get("fewshot_as_multiturn", False),
        }
        check_chat_settings(untruncated, **chat_settings)
        lm_eval_tasks = load_lm_eval_tasks(
            harness.tasks, include_path=harness.get("include_path"), include_defaults=harness.get("include_defaults", True)
        )

    # --- Model: built on the meta device, then loaded (or initialized from the seed), then its adapter -------------
    set_seed(cfg.seed)  # the same seed as training gives the same random base (LoRA on a random base)
    checkpointer = instantiate(cfg.checkpointer)
    with torch.device("meta"):
        model = instantiate(cfg.model)
        if cfg.adapter_dir is not None and not adapter_modules(model):
            # A plain builder: its LoRA/DoRA version, with the settings the adapter's adapter_config.json records.
            linear = adapter_linear(cfg.adapter_dir, model_family=checkpointer.family_name)
            model = instantiate(cfg.model, linear=linear)

    # The base from the checkpoint (or random from `seed`); on a LoRA model, the adapters of adapter_dir, or B = 0.
    fill = partial(fill_adapter_model, checkpointer=checkpointer, adapter_dir=cfg.adapter_dir)
    mesh = dims.build_mesh(env.device.type) if dims.is_sharded or dims.tp > 1 else None
    if mesh is not None:
        # Split and sharded before allocating: each rank only ever holds (and loads) its part of the model and
        # adapter. (A tensor-parallel model's data-parallel copies are FSDP2 with a shard group of one under ddp.)
        model = parallelize(
            model, dims=dims, device=env.device, dtype=precision.param_dtype, fill=fill,
            mp_policy=precision.fsdp_policy(), mesh=mesh,
        )
    else:
        # Nothing trains, so whole copies need no wrapper (DDP would allocate gradient buckets for nothing).
        materialize(model, device=env.device, dtype=precision.param_dtype)
        fill(model)
    autocast = precision.autocast(env.device, sharded=dims.uses_fsdp)
    # The ranks of a tensor-parallel group score the same samples: the work is split over the data-parallel ranks.
    dp_group = dims.dp_group(mesh)
    tokenizer = instantiate(cfg.tokenizer)
    results = {
        "checkpoint_dir": str(checkpointer.checkpoint_dir) if checkpointer.checkpoint_dir is not None else None,
        "adapter_dir": str(cfg.adapter_dir) if cfg.adapter_dir is not None else None,
        "seed": cfg.seed,
    }

    # --- Perplexity: every rank scores its slice of the dataset; sums are reduced exactly ----------------------------
    if cfg.get("dataset"):
        dataset = instantiate(cfg.dataset, tokenizer)
        loader = DataLoader(
            dataset,
            batch_size=cfg.micro_batch_size,
            sampler=ValidationSampler(len(dataset), rank=dims.dp_rank, world_size=dims.dp_size),
            collate_fn=partial(  # masks made on the device; packed batches all get the pack's shape
                padded_collate, pad_id=tokenizer.pad_id, attention_mask=False, pack_to=cfg.get("max_seq_len")
            ),
        )
        # As in training: FlexAttention block masks for packed documents and soft-capped scores on CUDA.
        flex_attention = resolve_flex_attention(cfg.get("flex_attention", "auto"), env.device)
        results.update(validation_loss(model, loader, device=env.device, autocast=autocast,
                                       flex_attention=flex_attention, loss_chunks=cfg.get("loss_chunks", 8),
                                       data_parallel_group=dp_group))

    # --- Generation tasks: greedy decoding, exact match ----------------------------------------------------------
    if cfg.get("eval_tasks"):
        tasks = instantiate(cfg.eval_tasks)
        if not tasks:
            raise UserError("eval_tasks: no samples to evaluate")
        correct, total = exact_match_accuracy(
            model, tokenizer, tasks, max_new_tokens=cfg.eval_max_new_tokens, rank=dims.dp_rank, world_size=dims.dp_size
        )
        results.update(accuracy=correct / total, correct=correct, total=total)

    # --- lm-evaluation-harness: every rank runs the harness; the model's work is shared out -----------------------
    if lm_eval_tasks is not None:
        results["lm_eval"] = run_lm_eval(
            model, untruncated, lm_eval_tasks, limit=harness.get("limit"), num_fewshot=harness.get("num_fewshot"),
            system_instruction=harness.get("system_instruction"), **chat_settings,
            batch_size=harness.get("batch_size", cfg.micro_batch_size), autocast=autocast, rank=dims.dp_rank,
            world_size=dims.dp_size, group=dp_group, seed=cfg.seed,
        )

    if env.is_rank_zero:
        path = write_report(results, output_dir)
        print(f"wrote {path}", flush=True)


@recipe_main(schema=SCHEMA)
def main(cfg: DictConfig) -> None:
    try:
        with sdpa_preference(cfg.get("sdpa_backend")):  # SDPA's backend order, before anything is compiled
            evaluate(cfg)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
