"""``tune plan``: the memory each data-parallel strategy (and tensor- or expert-parallel degree) needs for a config,
and what ``auto`` would pick.

Nothing is trained or allocated: the model is built on the meta device and counted
(:mod:`toolkit.planning.memory`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from omegaconf import DictConfig
from torch import nn

from toolkit.cli._catalog import config_for_recipe, list_configs, recipe_path, recipe_schema, split_launch_suffix
from toolkit.cli._threads import usable_cores
from toolkit.config import apply_overrides, instantiate, load_config, recipe_keys, validate
from toolkit.errors import UserError
from toolkit.modules.moe import MoEFeedForward, active_parameter_count, parameter_count
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.objectives.preference import preference_kernels
from toolkit.parallel.mesh import EXPERT_PARALLEL_STRATEGIES
from toolkit.planning.memory import (
    MemoryEstimate,
    StepKernels,
    estimate_memory,
    format_bytes,
    format_table,
    optimizer_memory_model,
)
from toolkit.planning.layout import (
    ParallelPlan,
    candidate_strategies,
    choose_layout,
    choose_strategy,
    device_memory_bytes,
    expert_parallel_degrees,
    plan_parallelism,
    tensor_parallel_degrees,
)
from toolkit.recipe_setup import (
    describe_backend,
    describe_method,
    describe_optimizer,
    header_lines,
)
from toolkit.rl import rl_kernels
from toolkit.training import resolve_flex_attention
from toolkit.training.accumulation import (
    gradient_accumulation_steps,
    micro_batch_within_share,
)
from toolkit.training.activations import checkpoint_interval

_GIB = 1024**3

DESCRIPTION = """\
Estimate per-device memory (parameters, gradients, optimizer state, activations, logits, gathered parameters)
for every data-parallel strategy, and show the one `data_parallel: auto` picks: the cheapest that fits.
The last line is the `tune run` command to use (recommended: ...): the layout and micro batch that the recipes'
auto settings pick (tensor_parallel, data_parallel and micro_batch_size auto, with activation checkpointing and
offloading turned on where nothing fits without them); where nothing fits, the nearest job that does (more
processes or nodes, a bigger device), or LoRA/QLoRA.

With tensor parallelism: a further table for each degree that splits the model's heads, key/value heads, MLP
width and vocabulary and divides the processes of one node (each process's shards, its heads' activations, its
vocabulary columns of the loss), or only for the configured `tensor_parallel=N`; and the layout
`tensor_parallel: auto` picks: no TP if that fits without offloading, else the smallest degree within a node that
fits, else offloading.

With a mixture-of-experts model: a further table for each expert-parallel degree that divides the experts and the
processes, under zero2 and zero3 without offloading, which it combines with (each process holds 1/N of every
layer's experts, sharded over the processes that hold the same ones, and gathers them as a unit of their own; the
token exchange adds its all-to-all buffers and a copy of the experts' output rows to the activations), or only for
the configured `expert_parallel=N`.

With `context_parallel=N`: every estimate for each process's share of every sequence (max_seq_len / N positions:
its activations, attention and loss), and the batch split over world size / (tensor_parallel x N) processes. For
training configs that set context_parallel (or with --longest), the longest max_seq_len that fits per device for
each layout of tensor and context parallel degrees (context_parallel 1, 2, 4, 8 where it divides the data-parallel
processes), under the strategy that holds least: what to set for long-context fine-tuning.

Reads the config keys model, micro_batch_size, max_seq_len, dtype (default bf16-mixed), activation_checkpointing,
activation_offloading, flex_attention, loss_chunks, fused_loss, data_parallel, tensor_parallel, expert_parallel,
context_parallel, cpu_offload, hsdp_shard_size, batch_size, optimizer, optimizer_in_backward and device_memory_gb. Plans are for GPUs:
flex_attention auto counts as on.

examples:
  tune plan full_finetune --config demo --device-memory-gb 24
  tune plan full_finetune --config llama3_1_8b --nproc_per_node 8 --device-memory-gb 80 max_seq_len=4096
  tune plan full_finetune --config llama3_1_70b --nproc_per_node 8 --device-memory-gb 80 tensor_parallel=auto
  tune plan full_finetune --config qwen3_moe_30b_a3b --nproc_per_node 8 --device-memory-gb 80 expert_parallel=8
  tune plan lora_finetune --config llama3_1_8b_lora_128k --nproc_per_node 8 --device-memory-gb 80"""


class _Parser(argparse.ArgumentParser):
    """One-line usage errors, like every other ``tune`` error."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; see `tune plan --help`")


def build_parser() -> argparse.ArgumentParser:
    """The ``tune plan`` argument parser."""
    parser = _Parser(prog="tune plan", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe name (a launch suffix is ignored) or recipe file")
    parser.add_argument("--config", required=True, help="config file, config name of the recipe, or recipe/config")
    parser.add_argument(
        "--nproc_per_node", "--nproc-per-node", type=int, help="processes per node (default: the GPUs here, else 1)"
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    parser.add_argument(
        "--device-memory-gb",
        "--device_memory_gb",
        type=float,
        help="memory of one device in GiB (default: this machine's GPU, else the config's device_memory_gb)",
    )
    parser.add_argument("--headroom", type=float, default=0.9, help="fraction of device memory a plan may use")
    parser.add_argument(
        "--longest", action="store_true",
        help="also the longest max_seq_len that fits for each tensor- and context-parallel layout (shown anyway for "
             "a config that sets context_parallel)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, as for tune run")
    return parser


def _load(recipe: str, config: str, overrides: list[str], *, world_size: int) -> tuple[DictConfig, Path]:
    # The same resolution as `tune run`: a recipe file, or a recipe name whose configs are looked up first.
    if recipe.endswith(".py") and Path(recipe).is_file():
        recipe_file = Path(recipe)
        path = config_for_recipe(config, None)
    else:
        recipe_file = recipe_path(recipe)  # an unknown recipe fails here, with a did-you-mean
        path = config_for_recipe(config, split_launch_suffix(recipe)[0])
    cfg = load_config(path)
    apply_overrides(cfg, overrides, recipe=recipe_keys(recipe_file))
    # What `tune run` checks, on the planned number of processes: a plan for a run that would be refused is none.
    validate(cfg, schema=recipe_schema(recipe_file), world_size=world_size)
    return cfg, path


def _positive_int(cfg: DictConfig, key: str) -> int:
    if key not in cfg:
        raise UserError(f"{key}: the config has none; add {key}=N to plan")
    value = cfg[key]
    if value == "auto":
        raise UserError(f"{key}: auto is found at run time; plan a fixed one with {key}=N")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{key}: must be a positive integer, got {value!r}")
    return value


def _optimizer_name(cfg: DictConfig) -> tuple[str, str | None]:
    """The memory model's optimizer name and a note when the config's is not one it knows."""
    component = str(cfg.get("optimizer", {}).get("_component_", "torch.optim.AdamW"))
    name = optimizer_memory_model(component)
    if name is not None:
        return name, None
    return "adamw", f"note: no memory model for optimizer {component}; counted as AdamW (2 states per parameter)"


def _world(args: argparse.Namespace) -> tuple[int, int, str | None]:
    """``(processes per node, nodes, note)``: the flags, or one process per local GPU."""
    if args.nnodes < 1:
        raise UserError(f"--nnodes must be at least 1, got {args.nnodes}")
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise UserError(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
        return args.nproc_per_node, args.nnodes, None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return gpus, args.nnodes, None
    return 1, args.nnodes, "note: no GPU here, so one process per node; plan for more with --nproc_per_node N"


def _device_memory(args: argparse.Namespace, cfg: DictConfig) -> tuple[int, str]:
    """Bytes of one device and where the number came from: the flag, this machine's GPU, or the config."""
    if args.device_memory_gb is not None:
        gib, source = args.device_memory_gb, "--device-memory-gb"
    elif torch.cuda.is_available() and (detected := device_memory_bytes(0)) is not None:
        return detected, torch.cuda.get_device_name(0)
    elif cfg.get("device_memory_gb") is not None:
        gib, source = cfg.device_memory_gb, "config device_memory_gb"
    else:
        raise UserError(
            "no GPU here to measure: say how much memory one device has with --device-memory-gb G "
            "(or device_memory_gb in the config)"
        )
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0:
        raise UserError(f"{source}: must be a positive number of GiB, got {gib!r}")
    return int(gib * _GIB), source


def step_kernels(cfg: DictConfig, model: nn.Module) -> tuple[StepKernels, list[Any], nn.Module | None]:
    """What the recipe's step holds besides the model, as the recipe sets it up: ``(kernels, adapters, teacher)``.

    ``model`` (on the meta device) trains only its adapters where it has some, as the LoRA recipe makes it; a
    preference config counts pairs and maybe a frozen reference copy; a distillation config's teacher is built on
    the meta device, frozen, and counted in every estimate.
    """
    flex_setting = cfg.get("flex_attention", "auto")
    if flex_setting not in (None, "auto", True, False):
        raise UserError(f"flex_attention: expected auto, true or false, got {flex_setting!r}")
    kernels = StepKernels(
        flex_attention=flex_setting is not False,  # plans are for GPUs (with Triton): auto counts as on
        loss_chunks=cfg.get("loss_chunks"),
        fused_loss=bool(cfg.get("fused_loss", True)),
    )
    adapters = get_adapter_params(model)
    if adapters:  # what the LoRA recipe does: only the adapters train
        set_trainable_params(model, adapters)
    if "preference_loss" in cfg:  # the preference recipe: pairs as two rows, and maybe a frozen reference copy
        kernels = preference_kernels(kernels, loss=cfg.preference_loss, adapters=bool(adapters),
                                     precompute=bool(cfg.get("precompute_reference", False)))
    if "num_generations" in cfg:  # online RL: each prompt is G sequences, and a full fine-tune's KL a frozen copy
        kernels = rl_kernels(dataclasses.replace(kernels, flex_attention=False),  # (the RL recipe runs SDPA)
                             num_generations=int(cfg.num_generations),
                             reference=bool(cfg.get("kl_coef")) and not adapters)
    teacher = None
    if "teacher_model" in cfg:  # distillation: a frozen teacher laid out like the student, in every estimate
        with torch.device("meta"):
            teacher = instantiate(cfg.teacher_model)
        teacher.requires_grad_(False)
        kernels = dataclasses.replace(kernels, frozen_model=teacher)
    return kernels, adapters, teacher


def _per_sample(cfg: DictConfig, kernels: StepKernels) -> str:
    """What one sample of a micro batch is, where it is more than one sequence: a pair, or an RL prompt's group."""
    if "num_generations" in cfg:
        return f" prompt(s) x {cfg.num_generations} completions"
    return " pairs" if kernels.sequences_per_sample == 2 else ""


def configured_memory(
    cfg: DictConfig, model: nn.Module, *, nproc: int, nnodes: int = 1, device_memory_gb: float, headroom: float = 0.9
) -> tuple[MemoryEstimate, int]:
    """What the config as it stands needs per device on ``nnodes x nproc`` devices of ``device_memory_gb`` GiB: its
    layout as the recipe resolves it there (its ``auto`` values chosen as at start-up), estimated, and the bytes a
    plan may use. What a config's header promises about hardware is checked with it (tests/test_recipe_configs.py).

    Raises:
        UserError: an ``auto`` value finds nothing that fits, or the config does not divide over the processes.
    """
    kernels, _, _ = step_kernels(cfg, model)
    world = nproc * nnodes
    optimizer, _ = _optimizer_name(cfg)
    common = {
        "max_seq_len": _positive_int(cfg, "max_seq_len"), "dtype": str(cfg.get("dtype", "bf16-mixed")),
        "activation_checkpointing": cfg.get("activation_checkpointing", False),
        "activation_offloading": bool(cfg.get("activation_offloading", False)),
        "optimizer_in_backward": bool(cfg.get("optimizer_in_backward", False)), "kernels": kernels,
        "shard_size": cfg.get("hsdp_shard_size"), "optimizer": optimizer,
        "expert_parallel": cfg.get("expert_parallel", 1),
    }
    context_parallel = cfg.get("context_parallel", 1)
    plan = plan_parallelism(
        model=model, strategy=str(cfg.get("data_parallel", "auto")), cpu_offload=bool(cfg.get("cpu_offload", False)),
        batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size, device=torch.device("cpu"),
        device_memory_gb=device_memory_gb, world_size=world, local_world_size=nproc, headroom=headroom,
        offload_candidates=True, tensor_parallel=cfg.get("tensor_parallel") or 1, context_parallel=context_parallel,
        **common,
    )
    dims = plan.dims
    common["max_seq_len"] = -(-common["max_seq_len"] // context_parallel)  # each process's positions of a row
    estimate = estimate_memory(
        model, strategy=dims.strategy, cpu_offload=dims.cpu_offload, world_size=world // dims.tp, num_nodes=nnodes,
        micro_batch_size=plan.micro_batch_size, gradient_accumulation_steps=plan.accumulation_steps,
        tensor_parallel=dims.tp, **common,
    )
    return estimate, int(headroom * device_memory_gb * _GIB)


def longest_fitting_sequence(total, usable: int, *, multiple: int = 1024, ceiling: int = 1 << 22) -> int:
    """The largest multiple of ``multiple`` up to ``ceiling`` whose ``total(seq_len)`` bytes fit ``usable`` (0 for
    none). The estimates grow with the sequence, linearly where attention's memory is (flash kernels, FlexAttention):
    the line through two lengths gives the answer, checked; where that check fails (a dense mask's square term), a
    binary search below it."""
    if total(multiple) > usable:
        return 0
    per_token = (total(2 * multiple) - total(multiple)) / multiple
    guess = ceiling if per_token <= 0 else min(ceiling, int((usable - total(multiple)) / per_token) + multiple)
    guess = max(multiple, guess // multiple * multiple)
    if total(guess) <= usable and (guess == ceiling or total(guess + multiple) > usable):
        return guess
    low, high = 1, guess // multiple  # total(low * multiple) fits; past high, nothing is tried
    while low < high:
        middle = (low + high + 1) // 2
        if total(middle * multiple) <= usable:
            low = middle
        else:
            high = middle - 1
    return low * multiple


def print_longest_sequences(model, *, degrees, world_size: int, nnodes: int, usable: int, common) -> None:
    """For each tensor- and context-parallel layout, the longest ``max_seq_len`` (a multiple of 1024) that a
    strategy without offloading fits in ``usable`` bytes per device, under the strategy that holds least."""
    print(f"longest max_seq_len that fits {format_bytes(usable)} per device (multiples of 1024), by layout:")
    for tp in degrees:
        dp = world_size // tp
        for cp in (c for c in (1, 2, 4, 8) if dp % c == 0):
            candidates = [(s, o) for s, o in candidate_strategies(world_size=dp, num_nodes=nnodes)
                          if not o and not (tp > 1 and s == "zero1")]

            @functools.cache
            def estimate(strategy: str, seq_len: int):
                return estimate_memory(model, strategy=strategy, cpu_offload=False, **common(tp, 1, cp, seq_len))

            try:
                # The strategies differ in what they hold of the model, not per token: the one holding least at
                # a short sequence holds least at every length.
                strategy = min((s for s, _ in candidates), key=lambda s: estimate(s, 1024).total)
                best = longest_fitting_sequence(lambda n: estimate(strategy, n).total, usable)
            except UserError:  # the batch does not split over this layout's reading processes
                continue
            layout = " x ".join(part for part in (
                f"tensor_parallel {tp}" if tp > 1 else "", f"context_parallel {cp}" if cp > 1 else "") if part)
            if best == 0:
                print(f"  {layout or 'data parallel only'}: not even 1024 tokens")
                continue
            there = estimate(strategy, best)
            print(f"  {layout or 'data parallel only'}: {best} tokens under {there.label} ({format_bytes(there.total)})")
    print()


# The keys a training recipe's plan reads: a config without them (generation, evaluation) has no plan to show.
_PLANNED_KEYS = ("model", "optimizer", "batch_size", "micro_batch_size", "max_seq_len", "data_parallel")


def resolved_plan(cfg: DictConfig, *, nproc_per_node: int | None, nnodes: int) -> list[str]:
    """What ``tune validate`` shows of a training config, already checked: the run's header (the method, optimizer
    and model code; processes, layout, micro batch and accumulation, steps) with the memory estimate per device and
    the reason for each ``auto`` choice, planned as ``tune run`` would plan it, on the meta device (no weights, no
    processes). Without ``nproc_per_node`` the processes are those ``tune run RECIPE_distributed`` starts here (one
    per GPU, else up to 4 on the CPU), said in a line. A plan that cannot be resolved here is a line saying why, not
    an error: the config passed its checks, and what the plan lacks may be the machine's (``auto`` sizes need the
    memory of devices this one may not have; the run may go to other machines). Empty for a config that is not a
    training run's (generation, evaluation).
    """
    if any(key not in cfg for key in _PLANNED_KEYS):
        return []
    lines = []
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wants_gpu = cfg.get("device", "auto") == "cuda" or (cfg.get("device", "auto") == "auto" and gpus > 0)
    nproc = nproc_per_node
    if nproc is None:
        nproc = gpus if wants_gpu and gpus else min(usable_cores(), 4)
        lines.append(f"assumed {nproc} process(es) per node, as `tune run <recipe>_distributed` starts here "
                     "(--nproc_per_node N for another count)")
    world = nproc * nnodes
    device = torch.device("cuda" if wants_gpu and gpus else "cpu")
    absent_gpus = wants_gpu and not gpus  # planned as tune plan plans them: their memory from the config
    try:
        with torch.device("meta"):
            model = instantiate(cfg.model)
        kernels, _, _ = step_kernels(cfg, model)
        if not absent_gpus and "num_generations" not in cfg:  # the run's device decides FlexAttention (RL: SDPA)
            kernels = dataclasses.replace(
                kernels, flex_attention=resolve_flex_attention(cfg.get("flex_attention", "auto"), device)
            )
        optimizer = optimizer_memory_model(str(cfg.optimizer.get("_component_"))) or "adamw"
        in_backward = bool(cfg.get("optimizer_in_backward", False))
        shape = {
            "batch_size": cfg.batch_size, "max_seq_len": cfg.max_seq_len, "dtype": str(cfg.get("dtype", "bf16-mixed")),
            "activation_checkpointing": cfg.get("activation_checkpointing", False),
            "activation_offloading": bool(cfg.get("activation_offloading", False)),
            "optimizer_in_backward": in_backward, "kernels": kernels, "shard_size": cfg.get("hsdp_shard_size"),
            "optimizer": optimizer, "expert_parallel": cfg.get("expert_parallel", 1),
        }
        context_parallel = cfg.get("context_parallel", 1)
        # What the checks ask of a given process count, asked here of an assumed one (which they did not see).
        split = context_parallel * (cfg.get("tensor_parallel", 1) if cfg.get("tensor_parallel", 1) != "auto" else 1)
        if world % split:
            raise UserError(f"tensor_parallel x context_parallel ({split}) does not divide the {world} processes")
        plan = plan_parallelism(
            model=model, strategy=str(cfg.data_parallel), cpu_offload=bool(cfg.get("cpu_offload", False)),
            micro_batch_size=cfg.micro_batch_size, device=device, device_memory_gb=cfg.get("device_memory_gb"),
            world_size=world, local_world_size=nproc, offload_candidates=True if absent_gpus else None,
            tensor_parallel=cfg.get("tensor_parallel", 1), context_parallel=context_parallel, **shape,
        )
    except UserError as error:
        return [*lines, f"plan not resolved for {world} process(es) on {'cuda' if wants_gpu else 'cpu'}: {error}"]
    dims = plan.dims
    shape.pop("batch_size")
    shape["max_seq_len"] = -(-cfg.max_seq_len // context_parallel)  # each process's positions of a row
    try:
        estimate = estimate_memory(
            model, strategy=dims.strategy, cpu_offload=dims.cpu_offload, world_size=world // dims.tp,
            num_nodes=nnodes, micro_batch_size=plan.micro_batch_size, tensor_parallel=dims.tp,
            gradient_accumulation_steps=plan.accumulation_steps, **shape,
        )
        memory = f"about {format_bytes(estimate.total)} per device (estimated)"
    except UserError as error:
        backend = getattr(model, "hf_config", None) is not None  # its layers are transformers', not the memory model's
        memory = f"memory not estimated ({'the transformers backend' if backend else error})"
    n_params = parameter_count(model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    trainable = f", {n_trainable / 1e6:.3f}M trainable" if n_trainable != n_params else ""
    steps = (f"at most {cfg.max_steps} steps" if cfg.get("max_steps") is not None
             else f"{cfg.get('epochs', 1)} epoch(s) of the data")
    lines += header_lines(
        f"{n_params / 1e6:.2f}M parameters{trainable}", method=describe_method(model),
        optimizer=describe_optimizer(cfg.optimizer, in_backward=in_backward),
        backend=describe_backend(model, cfg.model),
        processes=world, device_type=device.type if not absent_gpus else "cuda", layout=dims.label,
        precision=str(cfg.get("dtype", "bf16-mixed")), batch_size=cfg.batch_size,
        batch_unit="prompts" if "num_generations" in cfg else
        {None: "", "kto": "answers"}.get(cfg.get("preference_loss"), "pairs"), batch_ranks=dims.batch_ranks,
        micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.accumulation_steps, steps=steps,
        memory=memory,
    )
    return [*lines, *plan.reasons]
# Device sizes (GiB) a plan that fits nowhere tries, for "a bigger device": the common accelerators' memory.
_DEVICE_SIZES_GIB = (24, 40, 48, 80, 96, 141, 192, 288)
# Processes per node tried for "more processes" (up to a node of 8 GPUs), then nodes, at most this many.
_MAX_NODES = 64


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What ``tune plan`` recommends: the layout ``auto`` picks, with the switches it needed, for a job shape."""

    plan: ParallelPlan
    nproc: int
    nnodes: int
    switches: dict[str, Any]  # activation memory switches turned on to fit (activation_checkpointing=true...)


def recommend(cfg: DictConfig, *, nproc: int, nnodes: int, memory: int, plan_for) -> Recommendation | None:
    """The layout the recipes' ``auto`` settings pick for this config on ``nnodes x nproc`` devices of ``memory``
    bytes (``tensor_parallel``, ``data_parallel`` and ``micro_batch_size`` all ``auto``, as far as the config allows
    them: context parallelism and Muon keep the given degree), first as configured, then with activation
    checkpointing on every layer, then with activation offloading too.

    Args:
        plan_for: ``plan_for(world_size, local_world_size, memory, switches)`` runs
            :func:`~toolkit.planning.plan_parallelism` for the config with ``switches`` applied.

    Returns:
        None when nothing fits.
    """
    checkpointing = checkpoint_interval(cfg.get("activation_checkpointing", False)) == 1
    tries: list[dict[str, Any]] = [{}]
    if not checkpointing:
        tries.append({"activation_checkpointing": True})
    if not cfg.get("activation_offloading", False):
        tries.append({**tries[-1], "activation_offloading": True})
    for switches in tries:
        try:
            return Recommendation(plan_for(nproc * nnodes, nproc, memory, switches), nproc, nnodes, switches)
        except UserError:
            continue
    return None


def _smallest_fix(
    cfg: DictConfig, *, nproc: int, nnodes: int, memory: int, plan_for
) -> tuple[str, Recommendation | None]:
    """When nothing fits: the nearest job that does (more processes on a node of up to 8, then more nodes; else a
    bigger device), as words and its recommendation (None where none of these fits)."""
    shapes = [(p, 1) for p in (2, 4, 8) if nnodes == 1 and nproc < p]
    per_node = max(nproc, 8)
    shapes += [(per_node, n) for n in (2, 4, 8, 16, 32, _MAX_NODES) if n > nnodes]
    for p, n in shapes:
        found = recommend(cfg, nproc=p, nnodes=n, memory=memory, plan_for=plan_for)
        if found is not None:
            return f"it fits on {n * p} processes ({n} node(s) x {p})", found
    for gib in (g for g in _DEVICE_SIZES_GIB if g * _GIB > memory):
        found = recommend(cfg, nproc=nproc, nnodes=nnodes, memory=gib * _GIB, plan_for=plan_for)
        if found is not None:
            return f"it fits on devices of {gib} GiB", found
    largest = _DEVICE_SIZES_GIB[-1]
    return f"not on up to {_MAX_NODES} nodes of {per_node} processes, nor on devices of {largest} GiB", None


def recommended_command(cfg: DictConfig, found: Recommendation, *, recipe: str, config: str,
                        overrides: Sequence[str]) -> str:
    """``tune run`` with the launch and the overrides that make the run what ``found`` planned: the user's own
    overrides, then each planned value that differs from the config's."""
    dims = found.plan.dims
    planned = {
        "data_parallel": dims.strategy,
        "cpu_offload": dims.cpu_offload,
        "tensor_parallel": dims.tp,
        "micro_batch_size": found.plan.micro_batch_size,
        **found.switches,
    }
    defaults = {"cpu_offload": False, "tensor_parallel": 1, "activation_checkpointing": False,
                "activation_offloading": False}
    changed = {key: value for key, value in planned.items() if cfg.get(key, defaults.get(key)) != value}
    mine = [o for o in overrides if o.split("=", 1)[0].lstrip("~") not in changed]
    words = [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in changed.items()]
    world = found.nproc * found.nnodes
    if recipe.endswith(".py"):
        launch = [recipe]
    else:
        launch = [f"{split_launch_suffix(recipe)[0]}{'_distributed' if world > 1 else '_single_device'}"]
    if world > 1:
        launch = [*(["--nnodes", str(found.nnodes)] if found.nnodes > 1 else []), "--nproc_per_node",
                  str(found.nproc), *launch]
    return shlex.join(["tune", "run", *launch, "--config", config, *mine, *words])


def plan_command(argv: Sequence[str]) -> int:
    """Run ``tune plan`` with ``argv`` (the arguments after ``plan``): print the per-strategy memory table for a
    config and the strategy ``auto`` picks.

    Returns:
        0; problems (including a model that fits no strategy) raise :class:`~toolkit.errors.UserError`.
    """
    # Intermixed: key=value overrides may come after the flags, as in `tune run`.
    args = build_parser().parse_intermixed_args(list(argv))
    if not 0 < args.headroom <= 1:
        raise UserError(f"--headroom must be in (0, 1], got {args.headroom}")
    nproc, nnodes, world_note = _world(args)
    world_size = nproc * nnodes
    cfg, path = _load(args.recipe, args.config, args.overrides, world_size=world_size)
    if "model" not in cfg:
        raise UserError(f"{path}: model: the config has no model to plan for")
    auto_micro_batch = cfg.get("micro_batch_size") == "auto"
    micro_batch_size = 1 if auto_micro_batch else _positive_int(cfg, "micro_batch_size")
    max_seq_len = _positive_int(cfg, "max_seq_len")
    dtype = str(cfg.get("dtype", "bf16-mixed"))
    activation_checkpointing = cfg.get("activation_checkpointing", False)
    every_k_layers = checkpoint_interval(activation_checkpointing)
    activation_offloading = bool(cfg.get("activation_offloading", False))
    memory, memory_source = _device_memory(args, cfg)
    optimizer, optimizer_note = _optimizer_name(cfg)
    optimizer_in_backward = bool(cfg.get("optimizer_in_backward", False))
    with torch.device("meta"):  # shapes only: a 70B model costs nothing
        model = instantiate(cfg.model)
    kernels, adapters, teacher = step_kernels(cfg, model)
    shard_size = cfg.get("hsdp_shard_size")  # hsdp's groups, as the run makes them
    # The tensor-parallel degrees to show: the configured one, or (none or auto) every degree that splits the model
    # within one node, as tensor_parallel: auto would try them.
    configured_tp = cfg.get("tensor_parallel", None)
    auto_tp = configured_tp in (None, "auto")
    degrees = tensor_parallel_degrees(model, processes_per_node=nproc) if auto_tp else [configured_tp]
    tp_note = None
    if not auto_tp and configured_tp > nproc:
        tp_note = f"note: tensor_parallel {configured_tp} spans nodes (more than the {nproc} processes of one node)"
    run_tp = 1 if configured_tp is None else configured_tp  # what tune run would do with this config
    # The expert-parallel degrees to show, each a table: the configured one, or (none) every degree that shares out
    # the experts evenly over the data-parallel processes (a dense model has only 1).
    run_ep = cfg.get("expert_parallel", 1)
    run_cp = cfg.get("context_parallel", 1)  # each sequence split over this many data-parallel processes
    if run_cp > 1:  # only the degrees that leave whole context-parallel groups
        degrees = [tp for tp in degrees if (world_size // tp) % run_cp == 0] or degrees
    ep_degrees = [run_ep] if "expert_parallel" in cfg else expert_parallel_degrees(model, data_parallel_size=world_size)
    if optimizer == "muon":  # Muon steps whole matrices or FSDP2's row shards: the config check refuses TP and EP
        degrees, ep_degrees = [1], [1]
    layouts = [(tp, 1) for tp in degrees] if run_ep == 1 else []
    layouts += [(1, ep) for ep in ep_degrees if ep > 1]
    auto_note = None
    if auto_micro_batch:  # what tune run would pick, for the configured strategy (or the one auto picks)
        if "batch_size" not in cfg:
            raise UserError(f"{path}: micro_batch_size: auto needs batch_size")
        chosen = plan_parallelism(
            model=model, strategy=str(cfg.get("data_parallel", "auto")), cpu_offload=bool(cfg.get("cpu_offload")),
            batch_size=cfg.batch_size, micro_batch_size="auto", device=torch.device("cpu"),
            device_memory_gb=memory / _GIB, world_size=world_size, local_world_size=nproc, max_seq_len=max_seq_len,
            dtype=dtype, activation_checkpointing=activation_checkpointing,
            activation_offloading=activation_offloading, optimizer_in_backward=optimizer_in_backward,
            headroom=args.headroom, kernels=kernels, shard_size=shard_size, optimizer=optimizer,
            offload_candidates=True,  # plans are for GPUs, which may offload; the CPU here has nothing to say
            tensor_parallel=run_tp, expert_parallel=run_ep, context_parallel=run_cp,
        )
        micro_batch_size = chosen.micro_batch_size
        auto_note = "; ".join(chosen.reasons)

    def shape(tp: int, cp: int = run_cp) -> tuple[int, int]:
        """The micro batch and accumulation steps on ``world_size / (tp x cp)`` ranks that read distinct rows, as tune
        run cuts them."""
        if "batch_size" not in cfg:
            return micro_batch_size, 1
        dp = world_size // tp // cp
        micro = micro_batch_within_share(batch_size=cfg.batch_size, micro_batch_size=micro_batch_size, world_size=dp)
        return micro, gradient_accumulation_steps(batch_size=cfg.batch_size, micro_batch_size=micro, world_size=dp)

    def common(tp: int, ep: int = 1, cp: int = run_cp, seq_len: int = max_seq_len) -> dict[str, Any]:
        micro, accumulation = shape(tp, cp)
        return dict(
            world_size=world_size // tp,
            num_nodes=nnodes,
            micro_batch_size=micro,
            max_seq_len=-(-seq_len // cp),  # each process's positions of a row split over cp processes
            dtype=dtype,
            activation_checkpointing=activation_checkpointing,
            activation_offloading=activation_offloading,
            optimizer=optimizer,
            optimizer_in_backward=optimizer_in_backward,
            gradient_accumulation_steps=accumulation,
            kernels=kernels,
            shard_size=shard_size,
            tensor_parallel=tp,
            expert_parallel=ep,
        )

    n_params = parameter_count(model)
    n_active = active_parameter_count(model)
    active = f"{n_active / 1e6:,.2f}M active per token, " if n_active != n_params else ""
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    usable = int(args.headroom * memory)
    micro_batch_size, accumulation = shape(run_tp if run_tp in degrees else degrees[0])

    chunks = kernels.loss_chunks
    loss = f"in {chunks} chunks" if chunks else "in 1 chunk" if kernels.fused_loss else "whole"
    fused = kernels.fused_loss and model.fused_loss_weight() is not None
    loss = f"{'fused with the projection' if fused else 'on logits'}, {loss}"
    checkpointing = {0: "off", 1: "every layer"}.get(every_k_layers, f"every {every_k_layers} layers")
    print(f"plan for {path}")
    print(
        f"model: {cfg.model._component_}, {n_params / 1e6:,.2f}M parameters ({active}{n_trainable / 1e6:,.2f}M "
        "trainable); "
        f"micro batch {micro_batch_size}{_per_sample(cfg, kernels)} x {max_seq_len} "
        f"tokens{', a frozen reference model' if kernels.reference_model else ''}"
        f"{f', a frozen {sum(p.numel() for p in teacher.parameters()) / 1e6:,.2f}M-parameter teacher' if teacher else ''}"
        f", dtype {dtype}, activation checkpointing "
        f"{checkpointing}, offloading {'on' if activation_offloading else 'off'}, "
        f"flex_attention {'on' if kernels.flex_attention else 'off'}, "
        f"loss {loss}, {optimizer}"
        f"{' stepped inside backward' if optimizer_in_backward else ''}, {accumulation} "
        "accumulation step(s)"
    )
    print(
        f"devices: {nnodes} node(s) x {nproc} process(es) = world size {world_size}; {memory / _GIB:.2f} GiB each "
        f"({memory_source}), {usable / _GIB:.2f} GiB usable (headroom {args.headroom:g})"
    )
    cp_note = None
    if run_cp > 1:
        cp_note = (f"context_parallel {run_cp}: each sequence split over {run_cp} processes "
                   f"({cfg.get('context_parallel_method', 'ring')}), each holding {-(-max_seq_len // run_cp)} of its "
                   f"{max_seq_len} positions; the batch over {world_size // run_tp // run_cp} reading process(es)")
    for note in (world_note, optimizer_note, tp_note, auto_note, cp_note):
        if note:
            print(note)
    print()
    for tp, ep in layouts:
        candidates = candidate_strategies(world_size=world_size // tp, num_nodes=nnodes)
        micro, steps = shape(tp)
        if tp > 1:  # what combines with TP: no zero1, no offloading
            candidates = [(s, o) for s, o in candidates if not o and s != "zero1"]
            print(
                f"tensor_parallel {tp}: each layer split over {tp} processes, data parallelism over "
                f"{world_size // tp} rank(s); micro batch {micro}, {steps} accumulation step(s)"
            )
        if ep > 1:  # what combines with EP: zero2 and zero3, no offloading
            candidates = [(s, o) for s, o in candidates if not o and s in EXPERT_PARALLEL_STRATEGIES]
            experts = next(m.num_experts for m in model.modules() if isinstance(m, MoEFeedForward))
            peers = world_size // ep
            held = f"sharded over the {peers} processes holding the same ones" if peers > 1 else "whole"
            print(
                f"expert_parallel {ep}: each process holds {experts // ep} of every layer's {experts} experts, {held}; "
                f"tokens go to their experts and back by all-to-all; micro batch {micro}, {steps} accumulation step(s)"
            )
        estimates = [estimate_memory(model, strategy=s, cpu_offload=o, **common(tp, ep)) for s, o in candidates]
        print(format_table(estimates, usable_bytes=usable))
        if world_size // tp == 1:
            print(
                "(one process: nothing to shard over, every strategy runs as plain single-device training)" if tp == 1
                else f"(one data-parallel rank: the {tp} processes split each layer, nothing else)"
            )
        print()

    if "batch_size" in cfg and run_ep == 1 and (args.longest or "context_parallel" in cfg):
        print_longest_sequences(model, degrees=degrees, world_size=world_size, nnodes=nnodes, usable=usable,
                                common=common)
    configured = str(cfg.get("data_parallel", "auto"))
    if configured != "auto" and configured_tp != "auto":
        offload = bool(cfg.get("cpu_offload", False))
        mine = estimate_memory(model, strategy=configured, cpu_offload=offload, **common(run_tp, run_ep))
        verdict = "fits" if mine.total <= usable else "does NOT fit"
        print(f"config: data_parallel={mine.label} needs {format_bytes(mine.total)} per device: {verdict}")
    # What tensor_parallel: auto picks (with the configured data_parallel), and, without it, what data_parallel:
    # auto picks at the configured degree. The one the config asks for is the one whose failure is the error.
    layout_error = None
    if auto_tp and len(degrees) > 1 or configured_tp == "auto":
        try:
            strategy, tp, estimate, reason = choose_layout(
                model, device_memory_bytes=memory, world_size=world_size, num_nodes=nnodes, degrees=degrees,
                strategy=configured, cpu_offload=bool(cfg.get("cpu_offload", False)) if configured != "auto" else True,
                batch_size=cfg.get("batch_size"), micro_batch_size=micro_batch_size, max_seq_len=max_seq_len,
                dtype=dtype, activation_checkpointing=activation_checkpointing,
                activation_offloading=activation_offloading, optimizer=optimizer,
                optimizer_in_backward=optimizer_in_backward, headroom=args.headroom, kernels=kernels,
                shard_size=shard_size, expert_parallel=run_ep,
            )
            offload = " with cpu_offload: true" if estimate.cpu_offload else ""
            print(f"tensor_parallel auto picks: data_parallel={strategy}{offload}, tensor_parallel={tp} ({reason})")
        except UserError as error:
            layout_error = error
            if configured_tp != "auto":
                print(f"tensor_parallel auto picks nothing: {error}")
    nothing_fits = layout_error if configured_tp == "auto" else None
    if configured_tp != "auto":
        try:
            strategy, estimate, reason = choose_strategy(
                model, device_memory_bytes=memory, headroom=args.headroom, **common(run_tp, run_ep)
            )
            offload = " with cpu_offload: true" if estimate.cpu_offload else ""
            degree = (f" x tensor_parallel {run_tp}" if run_tp > 1 else
                      f" x expert_parallel {run_ep}" if run_ep > 1 else "")
            print(f"auto picks: data_parallel={strategy}{offload}{degree} ({reason})")
        except UserError as error:
            nothing_fits = error

    def plan_for(world: int, local: int, device_memory: int, switches: dict[str, Any]) -> ParallelPlan:
        """What the recipes' auto settings make of this config on ``world`` processes of ``device_memory`` bytes."""
        fixed = run_cp > 1 or optimizer == "muon"  # layouts auto cannot choose: the given degree and micro batch
        return plan_parallelism(
            model=model, strategy="auto", cpu_offload=False, batch_size=cfg.batch_size,
            micro_batch_size=cfg.micro_batch_size if fixed else "auto", device=torch.device("cpu"),
            device_memory_gb=device_memory / _GIB, world_size=world, local_world_size=local, max_seq_len=max_seq_len,
            dtype=dtype, activation_checkpointing=switches.get("activation_checkpointing", activation_checkpointing),
            activation_offloading=switches.get("activation_offloading", activation_offloading),
            optimizer_in_backward=optimizer_in_backward, headroom=args.headroom, kernels=kernels,
            shard_size=shard_size, optimizer=optimizer, offload_candidates=True,
            tensor_parallel=run_tp if fixed or run_ep > 1 else "auto", expert_parallel=run_ep, context_parallel=run_cp,
        )

    print(_recommendation_line(cfg, args, nproc=nproc, nnodes=nnodes, memory=memory, adapters=bool(adapters),
                               plan_for=plan_for))
    if nothing_fits is not None:
        raise nothing_fits
    return 0


def _recommendation_line(cfg: DictConfig, args: argparse.Namespace, *, nproc: int, nnodes: int, memory: int,
                         adapters: bool, plan_for) -> str:
    """``recommended: tune run ...``, or what fits nothing and the nearest job that would fit."""
    if "batch_size" not in cfg:
        return "recommended: (no batch_size in the config: nothing to lay out a training run for)"
    shape = {"nproc": nproc, "nnodes": nnodes, "memory": memory, "plan_for": plan_for}
    found = recommend(cfg, **shape)
    command = functools.partial(recommended_command, cfg, recipe=args.recipe, config=args.config,
                                overrides=args.overrides)
    if found is not None:
        return f"recommended: {command(found)}"
    where, nearer = _smallest_fix(cfg, **shape)
    tail = f": {command(nearer)}" if nearer is not None else ""
    lora = ""
    if not adapters:  # a full fine-tune: adapters hold a fraction of the gradients and optimizer state
        shipped = [c for c in (f"{Path(args.config).stem}_lora", f"{Path(args.config).stem}_qlora")
                   if c in list_configs("lora_finetune")]
        lora = f"; or LoRA/QLoRA: tune plan lora_finetune --config {shipped[0]}" if shipped else "; or LoRA/QLoRA"
    return (f"recommended: nothing fits {nnodes * nproc} process(es) of {memory / _GIB:.2f} GiB, even with "
            f"activation checkpointing and offloading; {where}{tail}{lora}")
