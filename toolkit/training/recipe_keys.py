"""The declared schema of the shared training vocabulary (docs/design.md's table), which the training recipes extend.

Every key a training recipe reads is declared here or in the recipe, with its type, range and choices, and the
rules between keys (the global batch divides over the processes) are functions of the values. The checks run in
``tune validate``, ``tune plan``, ``tune run`` before any process starts, and in the recipe before it touches
anything (see :mod:`toolkit.config._schema`).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from toolkit.config import instantiate
from toolkit.config._schema import (
    Bool,
    Choice,
    Component,
    Context,
    Float,
    Int,
    ListOf,
    Schema,
    Section,
    Str,
    one_of,
    rule,
)
from toolkit.errors import UserError
from toolkit.modules.attention import GroupedQueryAttention
from toolkit.modules.contract import DecoderModel
from toolkit.modules.position_embeddings import LongRopeRotaryEmbeddings
from toolkit.training.accumulation import gradient_accumulation_steps, micro_batch_within_share
from toolkit.training.attention_backend import SDPA_BACKENDS
from toolkit.training.metric_loggers import parse_metric_logger_spec
from toolkit.optim.muon import ADJUST_LR_FNS, NS_DTYPES
from toolkit.optim.optimizers import takes_parameter_names
from toolkit.parallel import STRATEGIES
from toolkit.parallel.context_parallel import CP_METHODS, context_parallel_problems
from toolkit.parallel.mesh import context_parallel_layout_problems, expert_parallel_problems, tensor_parallel_problems
from toolkit.parallel.expert_parallel import check_expert_parallel
from toolkit.parallel.tensor_parallel import check_tensor_parallel
from toolkit.training.precision import PRECISIONS
from toolkit.training.profiling import profiler_settings

DEVICES = ("auto", "cuda", "cpu")

# Keys every recipe that builds a model on a device reads.
MODEL_KEYS = {
    "model": Component(),
    "tokenizer": Component(),
    "checkpointer": Component(),
    "device": Choice(*DEVICES),
    "dtype": Choice(*PRECISIONS),
    "seed": Int(ge=0),
    "sdpa_backend": Choice("default", *SDPA_BACKENDS, null=True, required=False),
}

# Keys of recipes that spread a model over processes (training and evaluation).
PARALLEL_KEYS = {
    "data_parallel": Choice(*STRATEGIES, "auto"),
    "tensor_parallel": Int(ge=1, required=False),
    "hsdp_shard_size": Int(ge=1, null=True),
    "dist_timeout_s": Float(gt=0),
    "flex_attention": one_of(Bool(), Choice("auto"), null=True, required=False),
    "loss_chunks": Int(ge=1, null=True, required=False),
}

# Component arguments that every optimizer and schedule shares, checked whenever a config gives them; the
# optimizer is also built on a dummy parameter before launch, so whatever else its constructor refuses is caught.
OPTIMIZER_KEYS = {
    "optimizer.lr": Float(gt=0),
    "optimizer.weight_decay": Float(ge=0),
    "optimizer.eps": Float(gt=0),
    "optimizer.betas": ListOf(item=Float(ge=0, lt=1), length=2),
    # toolkit.optim.Muon's (see its docstring): the Muon group's Newton-Schulz iteration and learning-rate
    # adjustment, the AdamW group's hyperparameters, and which parameters Muon steps.
    "optimizer.momentum": Float(ge=0),
    "optimizer.nesterov": Bool(),
    "optimizer.ns_coefficients": ListOf(item=Float(), length=3),
    "optimizer.ns_steps": Int(ge=1, le=99),
    "optimizer.ns_dtype": Choice(*NS_DTYPES),
    "optimizer.adjust_lr_fn": Choice(*ADJUST_LR_FNS, null=True),
    "optimizer.adamw_lr": Float(gt=0),
    "optimizer.adamw_betas": ListOf(item=Float(ge=0, lt=1), length=2),
    "optimizer.adamw_eps": Float(gt=0),
    "optimizer.adamw_weight_decay": Float(ge=0),
    "optimizer.adamw_fused": Bool(null=True),
    "optimizer.muon_params": ListOf(item=Str(), null=True),
    "optimizer.muon_adapters": Bool(),
    "lr_scheduler.warmup_steps": Int(ge=0),
    "lr_scheduler.min_lr_ratio": Float(ge=0, le=1),
}

TRAINING_KEYS = {
    **MODEL_KEYS,
    **PARALLEL_KEYS,
    **OPTIMIZER_KEYS,
    "output_dir": Str(),
    "overwrite": Bool(),
    "progress_bar": Bool(),
    "max_seq_len": Int(ge=1),
    "dataset": Component(),
    "shuffle": Bool(required=False),
    "validation_dataset": Component(null=True, required=False),
    "eval_every_n_steps": Int(ge=1, null=True),
    "eval_tasks": Component(null=True, required=False),
    "eval_max_new_tokens": Int(ge=1),
    "batch_size": Int(ge=1),
    "micro_batch_size": one_of(Int(ge=1), Choice("auto")),
    # Training plans memory, so it may choose the degree (toolkit.planning.layout.choose_layout); evaluation and
    # generation take PARALLEL_KEYS' number.
    "tensor_parallel": one_of(Int(ge=1), Choice("auto"), required=False),
    "expert_parallel": Int(ge=1, required=False),
    "context_parallel": Int(ge=1, required=False),
    "context_parallel_method": Choice(*CP_METHODS, required=False),
    "device_memory_gb": Float(gt=0, null=True, required=False),
    "epochs": Int(ge=1),
    "max_steps": Int(ge=1, null=True),
    "optimizer": Component(),
    "lr_scheduler": Component(),
    "clip_grad_norm": Float(gt=0, null=True),
    "cpu_offload": Bool(),
    "activation_checkpointing": one_of(Bool(), Int(ge=1)),
    "activation_offloading": Bool(),
    "fused_loss": Bool(required=False),
    "sequence_parallel": Bool(required=False),
    "compile": Bool(required=False),
    "optimizer_in_backward": Bool(required=False),
    "float8": Bool(required=False),
    "log_every_n_steps": Int(ge=1),
    "metric_loggers": ListOf(null=True, required=False),
    "profiler": Section(null=True, required=False),
    "save_every_n_steps": Int(ge=1, null=True),
    "keep_last_n": Int(ge=1, null=True),
    "async_save": Bool(),
    "resume_from": Str(null=True),
}


def data_parallel_size(ctx: Context) -> int | None:
    """The data-parallel processes of the launch: all of them over ``tensor_parallel`` (None when not known, when
    ``tensor_parallel`` is ``auto``, chosen at run time, or when it does not divide them, which
    :func:`tensor_parallel_fits` reports)."""
    world, tp = ctx.world_size, ctx.get("tensor_parallel", 1)
    if world is None or tp == "auto" or world % tp:
        return None
    return world // tp


def batch_ranks(ctx: Context) -> int | None:
    """The processes that read distinct samples: the data-parallel ones over ``context_parallel`` (whose ranks share
    theirs); None when not known or when it does not divide them (:func:`context_parallel_fits` says so)."""
    dp, cp = data_parallel_size(ctx), ctx.get("context_parallel", 1)
    if dp is None or not isinstance(cp, int) or cp < 1 or dp % cp:
        return None
    return dp // cp


def _named_as_data_parallel(problem: str, ctx: Context) -> str:
    # The accumulation's message speaks of the world size; under TP or CP the batch divides over fewer ranks.
    tp, cp, ranks = ctx.get("tensor_parallel", 1), ctx.get("context_parallel", 1), batch_ranks(ctx)
    if (tp == 1 and cp == 1) or ranks is None:
        return problem
    over = " / ".join(f"{key} {n}" for key, n in (("tensor_parallel", tp), ("context_parallel", cp)) if n != 1)
    return problem.replace(
        f"world size ({ranks})", f"data-parallel size ({ranks}: {ctx.world_size} processes / {over})"
    )


@rule("batch_size", "micro_batch_size", "tensor_parallel", "context_parallel")
def batch_divides(ctx: Context) -> Iterator[tuple[str, str]]:
    """The global batch splits into whole micro-batches on every process that reads its own samples."""
    batch, micro, world = ctx.get("batch_size"), ctx.get("micro_batch_size"), batch_ranks(ctx)
    if batch is None or micro is None:
        return
    if micro == "auto":
        if world is not None and batch % world:
            yield "batch_size", f"{batch} does not split over {world} processes; use a multiple of {world}"
        return
    if world is None:  # any number of processes: at least whole micro-batches (one above the batch is cut to it)
        if batch % min(micro, batch):
            yield "batch_size", f"{batch} is not a multiple of micro_batch_size ({micro}), on any number of processes"
        return
    try:
        # As the run cuts it: a micro batch above a process's share of the batch is that share.
        micro = micro_batch_within_share(batch_size=batch, micro_batch_size=micro, world_size=world)
        gradient_accumulation_steps(batch_size=batch, micro_batch_size=micro, world_size=world)
    except UserError as e:
        yield "batch_size", _named_as_data_parallel(str(e).removeprefix("batch_size: "), ctx)


@rule("hsdp_shard_size", "data_parallel", "tensor_parallel")
def shard_groups_divide(ctx: Context) -> Iterator[tuple[str, str]]:
    """HSDP's shard groups tile the data-parallel processes."""
    shard, world = ctx.get("hsdp_shard_size"), data_parallel_size(ctx)
    if shard is not None and world is not None and world % shard:
        yield "hsdp_shard_size", f"{world} data-parallel processes cannot be split into shard groups of {shard}"


@rule("tensor_parallel", "data_parallel", "cpu_offload")
def tensor_parallel_fits(ctx: Context) -> Iterator[tuple[str, str]]:
    """``tensor_parallel`` divides the processes, and the data-parallel strategy can shard a TP model (``auto``
    chooses among the degrees that do)."""
    if ctx.get("tensor_parallel") == "auto":
        return
    yield from tensor_parallel_problems(
        tensor_parallel=ctx.get("tensor_parallel", 1), world_size=ctx.world_size,
        strategy=ctx.get("data_parallel"), cpu_offload=ctx.get("cpu_offload", False),
    )


@rule("expert_parallel", "data_parallel", "tensor_parallel", "cpu_offload")
def expert_parallel_fits(ctx: Context) -> Iterator[tuple[str, str]]:
    """``expert_parallel`` divides the data-parallel processes, under a strategy that shards the experts over the
    rest (zero2, zero3), without tensor parallelism or offloading. (Whether the model has experts it divides is
    checked when it is built.)"""
    yield from expert_parallel_problems(
        expert_parallel=ctx.get("expert_parallel", 1), world_size=data_parallel_size(ctx),
        strategy=ctx.get("data_parallel"), tensor_parallel=ctx.get("tensor_parallel", 1),
        cpu_offload=ctx.get("cpu_offload", False),
    )


@rule("context_parallel", "context_parallel_method", "tensor_parallel", "expert_parallel", "sequence_parallel",
      "micro_batch_size", "model")
def context_parallel_fits(ctx: Context) -> Iterator[tuple[str, str]]:
    """``context_parallel`` divides the data-parallel processes and, for ``alltoall``, each tensor-parallel rank's
    attention heads; what it does not combine with yet is refused by name. (A sequence is padded to a multiple of
    ``2 x context_parallel`` positions, so no length is refused.)"""
    cp = ctx.get("context_parallel", 1)
    if cp == 1:
        return
    tp = ctx.get("tensor_parallel", 1)
    with_cp = f"context_parallel={cp}"
    layout = context_parallel_layout_problems(
        context_parallel=cp, data_parallel_size=data_parallel_size(ctx), expert_parallel=ctx.get("expert_parallel", 1),
    )
    yield from layout
    if tp == "auto":
        yield "tensor_parallel", f"auto cannot combine with {with_cp} yet (the layout search does not split "\
            "sequences); give tensor_parallel a number"
    if ctx.get("micro_batch_size") == "auto":
        yield "micro_batch_size", f"auto cannot combine with {with_cp} yet; give micro_batch_size a number"
    if ctx.get("sequence_parallel"):
        yield "sequence_parallel", f"cannot combine with {with_cp} yet; remove one of them"
    model = None if layout else _meta_model(ctx.get("model"))  # (a layout that does not fit is the line to read)
    if model is None:
        return
    if not _toolkit_attention(model):  # (the transformers backend's layers are transformers')
        yield "context_parallel", f"{with_cp} needs one of the toolkit's decoder models (its attention layers split "\
            "the sequence), not the transformers backend"
        return
    if any(isinstance(module, LongRopeRotaryEmbeddings) for module in model.modules()):
        yield "context_parallel", f"{with_cp} cannot split a LongRoPE model's sequences yet (each rank would choose "\
            "the short or long rotary factors by its own positions); use context_parallel=1"
    if getattr(model, "_moe_blocks", None):
        yield "context_parallel", f"{with_cp} cannot split a mixture-of-experts model's sequences yet (its "\
            "load-balancing loss is per whole row); use context_parallel=1"
    yield from context_parallel_problems(
        context_parallel=cp, method=ctx.get("context_parallel_method", "ring"),
        num_heads=_first_layer(model).self_attn.num_heads, tensor_parallel=tp if isinstance(tp, int) else 1,
    )


@rule("sequence_parallel", "tensor_parallel")
def sequence_parallel_needs_tensor_parallel(ctx: Context) -> Iterator[tuple[str, str]]:
    """Sequence parallelism splits the sequence over the ranks of a tensor-parallel group: it needs one."""
    if ctx.get("sequence_parallel") and ctx.get("tensor_parallel", 1) == 1:
        yield "sequence_parallel", (
            "splits the sequence over the tensor-parallel ranks, and tensor_parallel is 1: set tensor_parallel to 2 "
            "or more, or remove sequence_parallel"
        )


@rule("tensor_parallel", "float8", "fused_loss")
def tensor_parallel_combines(ctx: Context) -> Iterator[tuple[str, str]]:
    """What tensor parallelism does not combine with (yet), refused by name."""
    tp = ctx.get("tensor_parallel", 1)
    if tp == 1:
        return
    # auto may choose a degree above 1, so it is refused with them too (tensor_parallel=1 keeps them).
    with_tp = f"tensor_parallel={tp}"
    if ctx.get("float8"):
        yield "float8", f"cannot combine with {with_tp} yet (float8 matmuls on split layers); remove one of them"
    if ctx.get("fused_loss") is False:
        yield "fused_loss", (
            f"{with_tp} needs the fused projection and loss, which computes the loss vocabulary-parallel (no rank "
            "holds whole logits); remove fused_loss=false"
        )


@rule("tensor_parallel", "expert_parallel", "cpu_offload", "model")
def parallelism_splits_the_model(ctx: Context) -> Iterator[tuple[str, str]]:
    """``tensor_parallel`` divides the model's heads, key/value heads, MLP width and vocabulary, and
    ``expert_parallel`` its experts: checked on the model built on the meta device (free, whatever its size)."""
    tp, ep, node = ctx.get("tensor_parallel", 1), ctx.get("expert_parallel", 1), ctx.get("model")
    checks = []
    # auto tries only the degrees that split it; a degree beyond the launch is tensor_parallel_fits' one line.
    if tp not in (1, "auto") and (ctx.world_size is None or tp <= ctx.world_size):
        checks.append(partial(check_tensor_parallel, tp=tp))
    if ep != 1 and not expert_parallel_problems(  # else expert_parallel_fits's line is the one to read
        expert_parallel=ep, world_size=data_parallel_size(ctx), strategy=ctx.get("data_parallel"), tensor_parallel=tp,
        cpu_offload=ctx.get("cpu_offload", False),
    ):
        checks.append(partial(check_expert_parallel, ep=ep))
    model = _meta_model(node) if checks else None
    if model is None:
        return
    for check in checks:
        try:
            check(model)
        except UserError as e:
            key, _, problem = str(e).partition(": ")
            yield key, problem


def _meta_model(node) -> torch.nn.Module | None:
    """The config's model built on the meta device (free, whatever its size); None without one, or for one that
    does not build, which the component's own checks report."""
    if node is None:
        return None
    try:
        with torch.device("meta"):
            return instantiate(node)
    except Exception:  # noqa: BLE001
        return None


@rule("optimizer")
def optimizer_accepts(ctx: Context) -> Iterator[tuple[str, str]]:
    """The optimizer's own constructor accepts its arguments (``betas`` beyond 1, a negative ``eps``...)."""
    node = ctx.get("optimizer")
    if node is None or takes_parameter_names(node):  # (muon_groups_fit builds those on the model's parameters)
        return
    # torch's optimizers check their hyperparameters before their parameters: given none, they stop at
    # "empty parameter list" once every value has passed, without the first parameter group's set-up, which imports
    # torch._dynamo (1.5 s of every `tune validate` and of every launch's first second). Others get one parameter.
    torchs = str(node.get("_component_", "")).startswith("torch.optim.")
    try:
        instantiate(node, [] if torchs else [torch.nn.Parameter(torch.zeros(1))])
    except ValueError as e:  # how torch's optimizers refuse a hyperparameter
        if not (torchs and "empty parameter list" in str(e)):
            yield "optimizer", f"{node.get('_component_')} refuses its arguments: {e}"
    except Exception:  # noqa: BLE001 (anything else is not about the values, and the run reports it in its place)
        return


@rule("optimizer", "model", "tensor_parallel", "expert_parallel", "optimizer_in_backward")
def muon_groups_fit(ctx: Context) -> Iterator[tuple[str, str]]:
    """An optimizer that chooses its groups by name (Muon) builds on the model's trainable parameters (built on the
    meta device): its ``muon_params`` select matrices only; and the layout is one it steps exactly."""
    node = ctx.get("optimizer")
    if node is None or not takes_parameter_names(node):
        return
    what = f"{node.get('_component_')} (the optimizer) orthogonalizes whole matrices (or FSDP2's row shards of them)"
    for key in ("tensor_parallel", "expert_parallel"):
        value = ctx.get(key, 1)
        # (auto may pick a degree above 1 at run time, on a GPU: refused here, before launch, as that degree would be)
        if value == "auto" or isinstance(value, int) and not isinstance(value, bool) and value > 1:
            yield key, (f"{what}, and {key} {value} splits them otherwise; set {key}=1, or use "
                        "torch.optim.AdamW")
            return
    if ctx.get("optimizer_in_backward"):
        yield "optimizer_in_backward", (f"{what} in one exchange per step over every rank's matrices, which a step "
                                        "per parameter during backward cannot do; set optimizer_in_backward=false")
        return
    model = _meta_model(ctx.get("model"))
    named = [] if model is None else [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    try:
        instantiate(node, named)
    except ValueError as e:  # "optimizer.<key>: <problem>"
        key, _, problem = str(e).partition(": ")
        yield (key, problem) if key.startswith("optimizer.") else ("optimizer", str(e))
    except Exception:  # noqa: BLE001 (not about the values: the run reports it in its place)
        return


def _first_layer(model: torch.nn.Module) -> torch.nn.Module | None:
    """The first decoder layer of a model that implements the contract and holds one, else None (a config's
    ``model`` may build any module)."""
    if not isinstance(model, DecoderModel):
        return None
    return next(iter(model.decoder_layers().values()), None)


def _toolkit_attention(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers attend with the toolkit's own attention (not the transformers backend's)."""
    return isinstance(getattr(_first_layer(model), "self_attn", None), GroupedQueryAttention)


@rule("eval_tasks", "model")
def eval_tasks_generate(ctx: Context) -> Iterator[tuple[str, str]]:
    """Held-out accuracy generates answers, with the KV caches of the toolkit's attention layers."""
    if not ctx.get("eval_tasks"):
        return
    model = _meta_model(ctx.get("model"))
    if model is not None and not _toolkit_attention(model):
        yield "eval_tasks", "generates with KV caches, which the transformers backend's layers do not have; set it null"


@rule("profiler")
def profiler_options(ctx: Context) -> Iterator[tuple[str, str]]:
    """Every ``profiler`` option is one the profiler takes."""
    try:
        profiler_settings(ctx.get("profiler"))
    except UserError as e:
        key, _, problem = str(e).partition(": ")
        yield key, problem


@rule("metric_loggers")
def metric_logger_options(ctx: Context) -> Iterator[tuple[str, str]]:
    """Every ``metric_loggers`` entry names a logger and only options it takes (its package is checked when built)."""
    for i, spec in enumerate(ctx.get("metric_loggers") or ()):
        try:
            parse_metric_logger_spec(spec)
        except UserError as e:
            yield f"metric_loggers[{i}]", str(e).removeprefix("metric_loggers: ")


TRAINING_SCHEMA = Schema(
    TRAINING_KEYS,
    rules=(
        batch_divides, shard_groups_divide, tensor_parallel_fits, tensor_parallel_combines, expert_parallel_fits,
        context_parallel_fits, sequence_parallel_needs_tensor_parallel,
        parallelism_splits_the_model, optimizer_accepts, muon_groups_fit, eval_tasks_generate, profiler_options,
        metric_logger_options,
    ),
)

