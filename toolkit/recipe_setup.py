"""The training recipes' own set-up, shared so that a fix lands once: each recipe reads as a sentence of these calls,
and keeps in its own file what makes it that recipe (its model, its loss, its loop).

    run = setup_run(cfg)                     # processes, device, precision; the checkpoint to resume, or None
    ...                                      # the recipe builds its model on the meta device
    layout = plan_layout(cfg, run=run, ...)  # the memory plan, its layout (every degree), the mesh
    model = parallelize_model(cfg, model, run=run, layout=layout, fill=...)
    ...                                      # the recipe builds its tokenizer, data and collate function
    data = build_data(cfg, layout=layout, dataset=..., collate=...)
    loop = start_training(cfg, run=run, layout=layout, model=model, data=data, ...)
    for epoch, micro_batches in loop.global_batches():
        result = ...                         # the recipe's forward and backward
        loop.optimizer_step(result, epoch=epoch)
        loop.end_step()
    loop.finish()
    ...                                      # the recipe saves its model into final/
    print_summary(loop, run=run, final=...)  # wall time, best held-out loss, outputs, the commands to run next

Unlike the rest of the toolkit, these functions read the config: they are the recipes' set-up, moved here whole.
What a recipe alone reads (its own keys, or the shared keys only some recipes take, such as ``context_parallel``)
it passes as keyword arguments, so that the keys a recipe reads are still exactly those of its schema
(:func:`toolkit.config.recipe_keys` follows ``cfg`` into the functions a recipe hands it to). The order is the
recipes' order, which matters: everything that can fail on the user's input is built before
:func:`start_training` claims the output folder, and nothing is written before.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from toolkit.checkpoint import StepCheckpointer, TrainingState, claim_output_dir, start_run
from toolkit.checkpoint.step_files import CHECKPOINTS_DIR
from toolkit.checkpoint.step_reader import resume_step
from toolkit.config import instantiate
from toolkit.data import GlobalBatchSampler, demo_data_warning
from toolkit.errors import NothingToDo, UserError
from toolkit.generation import report_exact_match
from toolkit.models import read_hf_config
from toolkit.modules.peft import training_method
from toolkit.optim import build_optimizer, check_optimizer_in_backward, fused_by_default
from toolkit.parallel import DistributedEnv, ParallelDims, init_distributed, on_rank_zero, unwrap
from toolkit.parallel.context_parallel import ContextParallel
from toolkit.paths import configs_dir
from toolkit.planning import ParallelPlan, StepKernels, optimizer_memory_model, plan_parallelism
from toolkit.training import (
    MetricsLogger,
    PrecisionPolicy,
    StepProfiler,
    StepResult,
    ValidationSampler,
    compile_model,
    flops_per_token,
    global_batches,
    inject_fault,
    make_grad_scaler,
    measure_peak_flops,
    optimizer_step,
    parallelize,
    precision_policy,
    static_lengths,
    step_metrics,
)
from toolkit.training.metric_loggers import build_metric_loggers_on_rank_zero
from toolkit.training.metrics import format_duration
from toolkit.training.watchdog import progress

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Run:
    """Where a run stands before anything is built.

    Attributes:
        env: this process's place in the job and its device.
        precision: the ``dtype`` policy, checked against the device.
        output_dir: the run's output folder (``output_dir``, ``~`` expanded); nothing is written there yet.
        resume: the step checkpoint to resume from (``resume_from``, or after a restart by torchrun the run's own
            newest), or None for a fresh start.
        base_checkpoint: the base weights' folder (``checkpointer.checkpoint_dir``), never inside a folder that
            ``overwrite`` clears.
        started: when the run was set up (``time.perf_counter``), for the wall time of its summary.
    """

    env: DistributedEnv
    precision: PrecisionPolicy
    output_dir: Path
    resume: Path | None
    base_checkpoint: str | None
    started: float = field(default_factory=time.perf_counter)


def setup_run(cfg: DictConfig) -> Run:
    """Join the process group, pick the device and the precision, and find where the run starts.

    The output folder is only checked (a writable folder, which ``overwrite`` may replace, or the run to resume):
    nothing in it is cleared or written until :func:`start_training`, once the inputs are built.

    Raises:
        UserError: no GPU where ``device: cuda`` asks for one, a precision the device lacks, a ``resume_from`` that is
            not a complete checkpoint, or an ``output_dir`` the run may not use.
    """
    env = init_distributed(device=cfg.device, timeout_s=cfg.dist_timeout_s)
    precision = precision_policy(cfg.dtype, device=env.device)
    output_dir = Path(cfg.output_dir).expanduser()
    base_checkpoint = cfg.checkpointer.get("checkpoint_dir")
    resume = on_rank_zero(
        start_run, output_dir, overwrite=cfg.overwrite, resume_from=cfg.resume_from, base_checkpoint=base_checkpoint
    )
    return Run(env, precision, output_dir, resume, base_checkpoint)


@dataclass(frozen=True)
class Layout:
    """How the run spreads over its processes, and what each step needs of that.

    Attributes:
        plan: the memory plan (``auto`` values resolved): its ``dims`` are the layout, its micro batch and
            accumulation steps split the global batch.
        mesh: the one device mesh every dimension is cut from (None for one process).
        dp_group: this rank's data-parallel peers, over which tokens and losses are summed (the ranks of a
            tensor-parallel group share their micro-batches); None where that is every rank.
        context_parallel: this rank's context-parallel group (None without context parallelism): the ranks of a
            group read the same rows, each computing its positions of them.
        autocast: the forward's autocast context (none where FSDP2 casts by itself, or not in a mixed precision).
    """

    plan: ParallelPlan
    mesh: DeviceMesh | None
    dp_group: dist.ProcessGroup | None
    context_parallel: ContextParallel | None
    autocast: contextlib.AbstractContextManager

    @property
    def dims(self) -> ParallelDims:
        """The layout: the data-parallel strategy and every degree (``plan.dims``)."""
        return self.plan.dims


def plan_layout(
    cfg: DictConfig,
    *,
    run: Run,
    model: nn.Module,
    kernels: StepKernels,
    activation_offloading: bool = False,
    optimizer_in_backward: bool = False,
    expert_parallel: int = 1,
    context_parallel: int = 1,
    context_parallel_method: str = "ring",
) -> Layout:
    """Plan the layout from a memory estimate of ``model`` (on the meta device) and build its mesh.

    Every degree is stated once, here: ``tensor_parallel`` from the config, and the degrees only some recipes
    take (``expert_parallel``, ``context_parallel``) from theirs. The plan resolves ``auto`` (``tensor_parallel``,
    ``data_parallel``, ``micro_batch_size``: the least-communicating layout that fits the device, then the largest
    micro batch that fits; the global batch never changes) and returns the layout those degrees make
    (:func:`~toolkit.planning.plan_parallelism`), which the mesh and every later step take. With
    ``optimizer_in_backward``, what it cannot do is refused here, before any weight is loaded.

    Args:
        cfg: the recipe's config.
        run: from :func:`setup_run`.
        model: the model, on the meta device (only shapes are read).
        kernels: how the step computes attention and the loss (the plan counts their memory).
        activation_offloading, optimizer_in_backward: the recipe's settings, which the estimate counts.
        expert_parallel: data-parallel ranks the experts are shared out over (mixture-of-experts models).
        context_parallel: data-parallel ranks each sequence is split over.
        context_parallel_method: how those ranks attend (``ring`` or ``alltoall``).

    Raises:
        UserError: a layout that does not fit the job or the device (see :func:`~toolkit.planning.plan_parallelism`
            and :func:`~toolkit.parallel.parallel_dims`), or what the step inside backward refuses.
    """
    env = run.env
    plan = plan_parallelism(
        model=model, strategy=cfg.data_parallel, cpu_offload=cfg.cpu_offload, batch_size=cfg.batch_size,
        micro_batch_size=cfg.micro_batch_size, device=env.device, device_memory_gb=cfg.get("device_memory_gb"),
        world_size=env.world_size, local_world_size=env.local_world_size, max_seq_len=cfg.max_seq_len,
        dtype=cfg.dtype, activation_checkpointing=cfg.activation_checkpointing,
        activation_offloading=activation_offloading, optimizer_in_backward=optimizer_in_backward, kernels=kernels,
        shard_size=cfg.hsdp_shard_size,
        optimizer=optimizer_memory_model(cfg.optimizer._component_) or "adamw",  # one it does not know: as AdamW
        tensor_parallel=cfg.get("tensor_parallel", 1), expert_parallel=expert_parallel,
        context_parallel=context_parallel, rank=env.rank,
    )
    dims = plan.dims
    mesh = dims.build_mesh(env.device.type)
    layout = Layout(
        plan=plan, mesh=mesh, dp_group=dims.dp_group(mesh),
        context_parallel=dims.context_parallel(env.device.type, context_parallel_method),
        autocast=run.precision.autocast(env.device, sharded=dims.uses_fsdp),
    )
    if optimizer_in_backward:
        check_optimizer_in_backward(
            dims=dims, micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.accumulation_steps,
            max_grad_norm=cfg.clip_grad_norm, grad_scaling=run.precision.needs_grad_scaler,
        )
    return layout


def parallelize_model(
    cfg: DictConfig,
    model: nn.Module,
    *,
    run: Run,
    layout: Layout,
    fill: Callable[[nn.Module], None],
    compile: bool = False,
    activation_offloading: bool = False,
) -> nn.Module:
    """Compile ``model`` (on the meta device) per layer if asked, then split it over the layout, materialize it
    and ``fill`` its weights (:func:`~toolkit.training.parallelize`): sharded strategies shard before allocating,
    so each rank only ever holds (and loads) its shard.

    Compiling comes first, so that activation checkpointing and offloading wrap the compiled layers; tensor-parallel
    layers compile for static shapes (torch 2.13 cannot trace DTensor layers for dynamic ones).
    """
    env, dims = run.env, layout.dims
    if compile:
        compile_model(model, device=env.device, dynamic=False if dims.tp > 1 else None)
    return parallelize(
        model, dims=dims, device=env.device, dtype=run.precision.param_dtype, fill=fill,
        mp_policy=run.precision.fsdp_policy(), activation_checkpointing=cfg.activation_checkpointing,
        activation_offloading=activation_offloading, mesh=layout.mesh,
        sequence_parallel=cfg.get("sequence_parallel", False),
    )


def row_padding(cfg: DictConfig, *, layout: Layout, part_multiple: int = 1) -> dict[str, Any]:
    """How long a collate function makes every batch's rows, as its ``pad_to_multiple_of`` and ``lengths``.

    Rows are padded to a multiple of the parts the layout cuts them into: the tensor-parallel degree under
    ``sequence_parallel`` (each rank then holds its part), ``2 x context_parallel`` chunks under context
    parallelism, each part a multiple of ``part_multiple`` long (float8's matmuls). Compiled under tensor
    parallelism (static shapes), a batch is one of 8 lengths up to ``max_seq_len``, each compiled once.
    """
    dims = layout.dims
    multiple = dims.row_multiple(sequence_parallel=cfg.get("sequence_parallel", False), part_multiple=part_multiple)
    static = cfg.get("compile") and dims.tp > 1
    return {"pad_to_multiple_of": multiple,
            "lengths": static_lengths(cfg.max_seq_len, multiple=multiple) if static else None}


@dataclass(frozen=True)
class Data:
    """The loaders of a run.

    Attributes:
        sampler: every batch-reading rank's slice of each global batch, in an order that does not depend on the
            layout; its position is part of every step checkpoint.
        loader: the training micro-batches.
        val_loader: the held-out set, each rank scoring a disjoint slice (None without one).
        total_steps: the run's optimizer steps (``epochs`` of the data, at most ``max_steps``).
    """

    sampler: GlobalBatchSampler
    loader: DataLoader
    val_loader: DataLoader | None
    total_steps: int


def build_data(
    cfg: DictConfig,
    *,
    layout: Layout,
    dataset: Dataset,
    collate: Callable,
    tokenizer: Any = None,
    validation_dataset: Dataset | None = None,
    val_collate: Callable | None = None,
) -> Data:
    """The sampler and loaders over ``dataset`` and the held-out set: every rank that reads distinct rows takes its
    slice of each global batch (``batch_size`` sequences, shuffled by ``seed`` unless ``shuffle`` is false), in
    micro-batches of the plan's size.

    Args:
        cfg: the recipe's config.
        layout: from :func:`plan_layout`.
        dataset, collate: the training data and how its rows become a micro-batch.
        tokenizer: what the config's ``validation_dataset`` is built with, after the training loader.
        validation_dataset: the held-out set, when the recipe built (and checked) it itself; otherwise the config's
            ``validation_dataset``, if any.
        val_collate: how held-out rows become a batch (default: ``collate``).

    Raises:
        UserError: a batch that does not split over the ranks, a dataset smaller than one global batch, or a
            held-out set that cannot be built.
    """
    dims, micro_batch_size = layout.dims, layout.plan.micro_batch_size
    sampler = GlobalBatchSampler(
        len(dataset), global_batch_size=cfg.batch_size, rank=dims.batch_rank, world_size=dims.batch_ranks,
        seed=cfg.seed,
        shuffle=cfg.get("shuffle", True),  # false: the dataset's own order (curricula, comparing with another tool)
    )
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate)
    if validation_dataset is None and cfg.get("validation_dataset"):
        validation_dataset = instantiate(cfg.validation_dataset, tokenizer)
    val_loader = None
    if validation_dataset is not None:  # the loss is exact on any number of ranks
        val_loader = DataLoader(
            validation_dataset, batch_size=micro_batch_size, collate_fn=val_collate or collate,
            sampler=ValidationSampler(len(validation_dataset), rank=dims.batch_rank, world_size=dims.batch_ranks),
        )
    total_steps = cfg.epochs * sampler.steps_per_epoch
    if cfg.max_steps is not None:
        total_steps = min(total_steps, cfg.max_steps)
    return Data(sampler, loader, val_loader, total_steps)


@dataclass(eq=False)
class TrainingLoop:
    """A run's training state and the bookkeeping around each step, as :func:`start_training` builds it: the
    recipe's loop calls :meth:`global_batches`, its own forward and backward, :meth:`optimizer_step` and
    :meth:`end_step`, then :meth:`finish`.

    Attributes:
        state: what a step checkpoint holds (model, optimizer, schedule, sampler, grad scaler).
        loader: the training micro-batches, over ``state.sampler``.
        accumulation_steps: micro-batches per optimizer step.
        checkpoints: the run's step checkpoints.
        log: the run's metrics (``metrics.jsonl``, the terminal, the metric loggers).
        step: optimizer steps done (from the resumed checkpoint, then counted here).
        total_steps: the run's last step.
        max_grad_norm: the global gradient norm clipped to (``clip_grad_norm``), or None.
        output_dir: the run's output folder (the profiler writes its traces there).
        device: this rank's device.
        rank: this process's global rank.
        gather_every_n_steps: the steps (and the last) whose record gathers every rank's time and memory.
        config: the run's config, kept in every step checkpoint.
        strategy: the data-parallel strategy, kept in every step checkpoint.
        world_size: the processes of the job.
        resumed: whether the run resumed from a step checkpoint.
        profiler: the torch profiler's options (``profiler_settings``), or None for none.
        flops_seq_len: the sequence length the model FLOPs per token are counted at, for the MFU on a GPU; None
            for no MFU.
        compute_dtype: the dtype the device's peak FLOP rate is measured in.
        eval_tasks: prompts and answers whose exact-match accuracy is reported before the first step (of a fresh
            start) and after the last, or None.
        tokenizer: the tokenizer the eval tasks' prompts are encoded and answers decoded with.
        eval_max_new_tokens: the longest answer generated for them (given with ``eval_tasks``).
        validate: the recipe's held-out metrics (``{"val_loss": ...}``, a collective), or None without a held-out
            set.
        validate_every_n_steps: the steps after which :meth:`end_step` validates (None: only when the recipe asks).
    """

    state: TrainingState
    loader: DataLoader
    accumulation_steps: int
    checkpoints: StepCheckpointer
    log: MetricsLogger
    step: int
    total_steps: int
    max_grad_norm: float | None
    output_dir: Path
    device: torch.device
    rank: int
    gather_every_n_steps: int
    config: DictConfig
    strategy: str
    world_size: int = 1
    resumed: bool = False
    profiler: Mapping[str, Any] | None = None
    flops_seq_len: int | None = None
    compute_dtype: torch.dtype = torch.bfloat16
    eval_tasks: list[dict] | None = None
    tokenizer: Any = None
    eval_max_new_tokens: int | None = None
    validate: Callable[[], dict[str, Any]] | None = None
    validate_every_n_steps: int | None = None
    _profiler: StepProfiler | None = field(default=None, init=False)
    _mfu: dict[str, float | None] = field(default_factory=dict, init=False)
    _started: float = field(default=0.0, init=False)
    _data_wait_s: float = field(default=0.0, init=False)
    _validated: tuple[int, dict[str, Any]] | None = field(default=None, init=False)  # the last validation's step
    _best_val: tuple[float, int] | None = field(default=None, init=False)  # the lowest val_loss and its step
    _accuracy: dict[str, float] = field(default_factory=dict, init=False)  # the eval tasks' "before" and "after"

    @property
    def best_validation(self) -> tuple[float, int] | None:
        """The lowest held-out ``val_loss`` of the run so far and the step it was taken at (None before any)."""
        return self._best_val

    @property
    def accuracy(self) -> dict[str, float]:
        """The eval tasks' exact-match accuracy ``before`` and ``after`` training, as far as reported."""
        return dict(self._accuracy)

    @property
    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """The fp16 loss scaler (None in other precisions), which the recipe's backward takes."""
        return self.state.grad_scaler

    def global_batches(self) -> Iterator[tuple[int, list[dict[str, torch.Tensor]]]]:
        """``(epoch, micro_batches)`` for each step still to run, its wait for the data timed.

        Before the first: the eval tasks' accuracy at the start (a fresh start only), then the profiler's window
        and the MFU's peak FLOP rate (measured on the device) start, and the model is put in training mode.
        """
        if self.eval_tasks and not self.resumed:
            self._report_exact_match("before")
        if self.profiler is not None:  # a torch.profiler trace of a window of steps (`profiler.enabled`)
            self._profiler = StepProfiler(self.output_dir, rank=self.rank, **self.profiler)
        if self.flops_seq_len is not None:
            self._mfu = dict(
                flops_per_token=flops_per_token(unwrap(self.state.model), seq_len=self.flops_seq_len),
                peak_flops=measure_peak_flops(self.device, self.compute_dtype),
            )
        self.state.model.train()
        data_requested = time.perf_counter()
        for epoch, micro_batches in global_batches(
            self.loader, self.state.sampler, accum_steps=self.accumulation_steps
        ):
            if self.step >= self.total_steps:
                break
            self._started = time.perf_counter()
            self._data_wait_s = self._started - data_requested  # reading and collating this step's micro-batches
            yield epoch, micro_batches
            data_requested = time.perf_counter()

    def optimizer_step(self, result: StepResult, *, epoch: int) -> None:
        """After the recipe's forward and backward of a step: clip, step the optimizer and the schedule, advance the
        sampler and the step count, and log the step's metrics."""
        forward_backward_s = time.perf_counter() - self._started
        state = self.state
        grad_norm = optimizer_step(
            state.model, state.optimizer, max_grad_norm=self.max_grad_norm, grad_scaler=state.grad_scaler
        )
        lr = state.lr_scheduler.get_last_lr()[0]
        state.lr_scheduler.step()
        state.sampler.advance()
        self.step += 1
        progress(f"step {self.step}")  # the watchdog's sign of life
        self.log.log(step_metrics(
            step=self.step, epoch=epoch, result=result, lr=lr, grad_norm=grad_norm,
            elapsed_s=time.perf_counter() - self._started, device=self.device, data_wait_s=self._data_wait_s,
            forward_backward_s=forward_backward_s,
            gather_rank_stats=self.step % self.gather_every_n_steps == 0 or self.step == self.total_steps,
            **self._mfu,
        ))
        if self._profiler is not None:
            self._profiler.step()

    def end_step(self) -> None:
        """Validate when due (every ``validate_every_n_steps``), then save the step checkpoint when one is due
        (every ``save_every_n_steps``, and after the last step)."""
        if self.validate is not None and self.validate_every_n_steps and self.step % self.validate_every_n_steps == 0:
            self.validation()
        if self.checkpoints.due(self.step, self.total_steps):
            self.checkpoints.save(self.step, self.state, config=self.config, strategy=self.strategy)
        inject_fault("after_step", step=self.step, rank=self.rank)  # a testing hook: see toolkit.training.debug

    def validation(self) -> dict[str, Any]:
        """Run the held-out metrics now, log them under the current step and return them."""
        metrics = self.validate()
        self.log.log({"step": self.step, **metrics})
        self._validated = (self.step, metrics)
        if "val_loss" in metrics and (self._best_val is None or metrics["val_loss"] < self._best_val[0]):
            self._best_val = (metrics["val_loss"], self.step)
        return metrics

    def final_validation(self) -> dict[str, Any]:
        """The held-out metrics after the last step: those :meth:`end_step` took at this step, or taken now."""
        if self._validated is not None and self._validated[0] == self.step:
            return self._validated[1]
        return self.validation()

    def finish(self) -> None:
        """After the loop: wait for the last checkpoint to be complete, close the profiler, and report the eval
        tasks' accuracy after training."""
        self.checkpoints.wait()
        if self._profiler is not None:
            self._profiler.close()
        if self.eval_tasks:
            self._report_exact_match("after")

    def _report_exact_match(self, when: str) -> None:
        self._accuracy[when] = report_exact_match(
            self.state.model, self.tokenizer, self.eval_tasks, max_new_tokens=self.eval_max_new_tokens,
            rank=self.rank, world_size=self.world_size, when=when, log=self.log.print,
        )


def start_training(
    cfg: DictConfig,
    *,
    run: Run,
    layout: Layout,
    model: nn.Module,
    data: Data,
    recipe: str,
    base_checkpoint: str | Path | None,
    trainable_only: bool = False,
    optimizer_in_backward: bool = False,
    profiler: Mapping[str, Any] | None = None,
    measure_mfu: bool = False,
    eval_tasks: list[dict] | None = None,
    tokenizer: Any = None,
    validate: Callable[[], dict[str, Any]] | None = None,
) -> TrainingLoop:
    """The optimizer and schedule over what trains in ``model`` (built after sharding: FSDP2's parameters are
    DTensors), the step checkpoints and the resumed state, then the output folder and the metrics.

    When resuming, every weight, the optimizer, the schedule, the fp16 loss scale, the data position and every
    rank's RNG come from the checkpoint (:class:`~toolkit.checkpoint.StepCheckpointer`), on any number of
    processes, once it is known to be this recipe's and method's, and not past the run's last step
    (:func:`resume_point`). A fresh start claims the output folder only now, once everything that can fail on the
    user's input is built and checked (:func:`claim_output`).

    Args:
        cfg: the recipe's config.
        run, layout, model, data: from :func:`setup_run`, :func:`plan_layout`, :func:`parallelize_model` and
            :func:`build_data`.
        recipe: the recipe's name (``full_finetune``...), which its step checkpoints record, with how ``model``
            trains (:func:`~toolkit.modules.peft.training_method`): only the same recipe and method resume them.
        base_checkpoint: the checkpointer's folder, whose config and tokenizer files every step checkpoint keeps.
        trainable_only: step checkpoints hold only what trains (adapters, their optimizer state); the frozen rest
            comes from the base checkpoint on resume.
        optimizer_in_backward: one optimizer per parameter, stepped in backward (gradients freed at once).
        profiler: the torch profiler's options (``profiler_settings``), or None for none.
        measure_mfu: log the model FLOPs utilization on a GPU.
        eval_tasks, tokenizer: the config's ``eval_tasks`` as built, whose exact-match accuracy is reported before
            and after training (answers at most ``eval_max_new_tokens`` long), and the tokenizer they use.
        validate: the recipe's held-out metrics over ``data.val_loader`` (called only with one), taken every
            ``eval_every_n_steps`` steps.

    Raises:
        UserError: an optimizer or schedule the config cannot build, step checkpoints on storage the nodes do not
            share, a checkpoint of another recipe or method, past the run's last step or that does not fit the
            model, or an output folder that cannot be claimed.
        NothingToDo: the run resumed is complete (see :func:`resume_point`); nothing was changed.
    """
    method = training_method(model)
    if run.resume is not None:
        complete = on_rank_zero(resume_point, run=run, data=data, recipe=recipe, method=method,
                                max_steps=cfg.max_steps, epochs=cfg.epochs)
        if complete is not None:
            raise NothingToDo(complete)
    dims = layout.dims
    grad_scaler = make_grad_scaler(
        enabled=run.precision.needs_grad_scaler, device=run.env.device, sharded=dims.uses_fsdp or dims.tp > 1,
        data_parallel_size=dims.dp_size,  # fp16: the same steps overflow on any number of processes
    )
    optimizer = build_optimizer(
        cfg.optimizer, model=model, dims=dims, grad_scaler=grad_scaler, in_backward=optimizer_in_backward
    )
    lr_scheduler = instantiate(cfg.lr_scheduler, optimizer, total_steps=data.total_steps)
    state = TrainingState(model, optimizer, lr_scheduler, data.sampler, grad_scaler)
    checkpoints = StepCheckpointer(
        run.output_dir, every_n_steps=cfg.save_every_n_steps, keep_last_n=cfg.keep_last_n, async_save=cfg.async_save,
        trainable_only=trainable_only, base_checkpoint=base_checkpoint, data_parallel_size=dims.dp_size,
        recipe=recipe, method=method,
    )
    step = checkpoints.load(run.resume, state, config=cfg) if run.resume is not None else 0
    log = claim_output(cfg, run=run, step=step, total_steps=data.total_steps)
    if run.resume is not None:
        log.print(f"resumed at step {step} from {run.resume}")
    return TrainingLoop(
        state=state, loader=data.loader, accumulation_steps=layout.plan.accumulation_steps, checkpoints=checkpoints,
        log=log, step=step, total_steps=data.total_steps, max_grad_norm=cfg.clip_grad_norm, output_dir=run.output_dir,
        device=run.env.device, rank=run.env.rank, gather_every_n_steps=cfg.log_every_n_steps, config=cfg,
        strategy=dims.strategy, world_size=run.env.world_size, resumed=run.resume is not None, profiler=profiler,
        flops_seq_len=cfg.max_seq_len if measure_mfu else None, compute_dtype=run.precision.compute_dtype,
        eval_tasks=eval_tasks, tokenizer=tokenizer, eval_max_new_tokens=cfg.eval_max_new_tokens,
        validate=validate if data.val_loader is not None else None, validate_every_n_steps=cfg.eval_every_n_steps,
    )


def resume_point(
    *, run: Run, data: Data, recipe: str, method: str, max_steps: int | None, epochs: int
) -> str | None:
    """Check the checkpoint ``run`` resumes from before anything is read from it: this recipe's and method's, and
    not past the run's last step (``data.total_steps``: ``epochs``, at most ``max_steps``). Returns None, or the line
    saying that the run is already complete.

    A checkpoint at the last step of its own run (in ``output_dir``), whose ``final/`` is written, leaves nothing to
    do: the run is complete and nothing is changed (``resume_from=auto`` on a finished run, as after a restart). A
    checkpoint past the last step (``max_steps`` lowered since) is refused rather than taken as finished: its
    weights are not those of the run asked for, and ``final/`` would claim they were.

    Raises:
        UserError: another recipe's or method's checkpoint, or one past the last step; the line names both.
    """
    step = resume_step(run.resume, recipe=recipe, method=method)
    total = data.total_steps
    if step > total:
        epoch_steps = data.sampler.steps_per_epoch
        limit = (f"max_steps={max_steps}" if max_steps is not None and max_steps < epochs * epoch_steps
                 else f"epochs={epochs} of {epoch_steps} steps")
        raise UserError(
            f"resume_from: {run.resume} is at step {step}, past this run's last step, {total} ({limit}); raise it to "
            "train on from there, or export that checkpoint (tune export)"
        )
    own = run.resume.parent.resolve() == (run.output_dir / CHECKPOINTS_DIR).resolve()
    if step == total and own and (run.output_dir / "final").is_dir():
        return (
            f"{run.output_dir}: the run is complete: its last step checkpoint, {run.resume.name}, is at step {step} "
            f"of {total} and final/ is written; nothing to do (raise max_steps or epochs to train on)"
        )
    return None


def claim_output(cfg: DictConfig, *, run: Run, step: int, total_steps: int) -> MetricsLogger:
    """Claim the output folder and open the run's metrics; the last set-up step that can fail on the user's input.

    The metric loggers (TensorBoard, W&B, MLflow, stdout, besides ``metrics.jsonl``) are built on rank zero first:
    packages imported, options and the W&B login checked; they write nothing until their first record. Only then is
    an old run in ``output_dir`` cleared (``overwrite``) for a fresh start, and the config written beside the
    metrics (``config.yaml``).
    """
    loggers = build_metric_loggers_on_rank_zero(
        cfg.get("metric_loggers") or [], output_dir=run.output_dir, initial_step=step
    )
    if run.resume is None:
        on_rank_zero(claim_output_dir, run.output_dir, overwrite=cfg.overwrite, base_checkpoint=run.base_checkpoint)
    log = MetricsLogger(
        run.output_dir, enabled=run.env.is_rank_zero, total_steps=total_steps, initial_step=step,
        progress_bar=cfg.progress_bar, loggers=loggers,
        log_every_n_steps=cfg.log_every_n_steps,  # a loss line on the terminal every N steps
    )
    log.log_config(cfg)
    if run.env.is_rank_zero:
        OmegaConf.save(cfg, run.output_dir / "config.yaml")
        # Once the inputs are known good (a bad one ends with its one error line, and nothing more), before step 1.
        if warning := demo_data_warning(cfg):
            _logger.warning(warning)
    return log


def describe_method(model: nn.Module) -> str:
    """What trains, read from the model's layers (on the meta device too): ``full fine-tuning``, or ``LoRA``,
    ``DoRA``, ``QLoRA`` (the frozen base in NF4) or ``QDoRA``: the method a step checkpoint records, in words."""
    method = training_method(unwrap(model))
    return "full fine-tuning" if method == "full" else method.upper().replace("DORA", "DoRA").replace("LORA", "LoRA")


def describe_optimizer(
    optimizer_cfg: DictConfig, *, in_backward: bool = False, grad_scaler: torch.amp.GradScaler | None = None
) -> str:
    """The optimizer in a few words, as the run will build it: ``fused AdamW``, ``Muon``, ``8-bit AdamW``
    (torchao's ``AdamW8bit``), with `` stepped in backward`` for ``optimizer_in_backward``."""
    name = str(optimizer_cfg.get("_component_", "?")).rsplit(".", 1)[-1]
    if bits := re.fullmatch(r"(\w+?)(\d+)bit", name):
        name = f"{bits[2]}-bit {bits[1]}"
    if fused_by_default(optimizer_cfg, grad_scaler=grad_scaler).get("fused"):  # torch's Adam(W), fused by default
        name = f"fused {name}"
    return f"{name} stepped in backward" if in_backward else name


def describe_backend(model: nn.Module, model_cfg: DictConfig) -> str:
    """Which code the model is: a native family (``llama3``, the package its builder is in, or the family
    ``build_from_hf`` found for the checkpoint) or ``transformers (olmo2)`` for the transformers backend."""
    plain = unwrap(model)
    hf_config = getattr(plain, "hf_config", None)
    if hf_config is not None:
        return f"transformers ({hf_config.model_type})"
    parts = str(model_cfg.get("_component_", "")).split(".")
    if parts[-1] == "build_from_hf" and model_cfg.get("path"):
        return read_hf_config(model_cfg.path)[1]
    if parts[:2] == ["toolkit", "models"] and len(parts) > 3:
        return parts[2]
    return type(plain).__name__


def _count(n: int, word: str, plural: str | None = None) -> str:
    return f"{n} {word if n == 1 else plural or word + 's'}"


def header_lines(
    what: str,
    *,
    method: str,
    optimizer: str,
    backend: str,
    processes: int,
    device_type: str,
    threads: int | None = None,
    layout: str,
    precision: str,
    batch_size: int,
    batch_unit: str = "",
    batch_ranks: int,
    micro_batch_size: int,
    accumulation_steps: int,
    steps: str,
    memory: str | None = None,
) -> list[str]:
    """The two lines that say what a run is: the recipe's own words (``what``), the method, the optimizer and the
    model's code; then its shape: ``2 processes on cpu (1 thread each), ddp, fp32; global batch 32 = 2 x 16 x 1
    accumulation step; 30 steps`` (one process names no data-parallel strategy: it has nothing to spread over),
    and the memory each device is estimated to hold where given. ``threads`` are each CPU process's (CPU processes
    share the cores: part of the speed), where known. The run's header and ``tune validate`` print these lines."""
    where = f"{_count(processes, 'process', 'processes')} on {device_type}"
    if threads is not None:
        where += f" ({_count(threads, 'thread')}{' each' if processes > 1 else ''})"
    if processes > 1:
        where += f", {layout}"
    unit = f" {batch_unit}" if batch_unit else ""
    shape = (f"{where}, {precision}; global batch {batch_size}{unit} = {batch_ranks} x {micro_batch_size} x "
             f"{_count(accumulation_steps, 'accumulation step')}; {steps}")
    if memory:
        shape += f"; {memory}"
    return [f"{what}; {method}, {optimizer}, {backend}", shape]


def print_header(
    log: MetricsLogger,
    what: str,
    *,
    run: Run,
    layout: Layout,
    data: Data,
    batch_size: int,
    batch_unit: str = "",
    notes: Sequence[str] = (),
    loop: TrainingLoop | None = None,
) -> None:
    """Print the run's header (:func:`header_lines`): ``what`` (the recipe's own words: its parameters, its
    objective), with the ``loop`` its method, optimizer and model code, then its shape (``batch_unit`` names what
    ``batch_size`` counts where that is not sequences); then the reason for each ``auto`` choice of the plan, and
    the recipe's ``notes``, a line each."""
    env, dims, plan = run.env, layout.dims, layout.plan
    if loop is not None:
        cfg = loop.config
        described = {
            "method": describe_method(loop.state.model), "backend": describe_backend(loop.state.model, cfg.model),
            "optimizer": describe_optimizer(cfg.optimizer, in_backward=cfg.get("optimizer_in_backward", False),
                                            grad_scaler=loop.grad_scaler),
        }
    lines = header_lines(
        what, **(described if loop is not None else {"method": "", "optimizer": "", "backend": ""}),
        processes=env.world_size, device_type=env.device.type, layout=dims.label,
        threads=torch.get_num_threads() if env.device.type == "cpu" else None, precision=run.precision.name,
        batch_size=batch_size, batch_unit=batch_unit, batch_ranks=dims.batch_ranks,
        micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.accumulation_steps,
        steps=_count(data.total_steps, "step"),
    )
    if loop is None:  # (a recipe copied before the loop was passed: its own words alone)
        lines[0] = what
    for line in (*lines, *plan.reasons, *notes):
        log.print(line)


def print_summary(loop: TrainingLoop, *, run: Run, final: Path | None = None) -> None:
    """The run's last lines, on rank zero: its wall time (a resumed run's: this attempt's), the best held-out loss
    (and its step) and the eval tasks' accuracy before and after where there are any, where its outputs are, and
    the commands to try next with them (generating from ``final``: the Hugging Face model, or a PEFT adapter under
    ``final/adapter`` and the merged model under ``final/merged``; merging an adapter; exporting a step
    checkpoint)."""
    if not run.env.is_rank_zero:
        return
    done = [f"done: {_count(loop.step, 'step')} in {format_duration(time.perf_counter() - run.started)}"
            + (f" (this attempt, resumed from {run.resume.name})" if run.resume is not None else "")]
    if loop.best_validation is not None:
        done.append(f"best val_loss {loop.best_validation[0]:.4f} at step {loop.best_validation[1]}")
    accuracy = loop.accuracy
    if "after" in accuracy:
        before = f"{accuracy['before']:.1%} -> " if "before" in accuracy else ""
        done.append(f"held-out accuracy {before}{accuracy['after']:.1%}")
    out = run.output_dir
    adapter = merged = None
    if final is not None:
        adapter = final / "adapter" if (final / "adapter").is_dir() else None
        merged = final / "merged" if (final / "merged").is_dir() else None
    checkpoints = out / "checkpoints"
    kept = [(final if adapter is None and merged is None else None, "the model, Hugging Face files"),
            (adapter, "PEFT adapter"), (merged, "merged model"),
            (checkpoints if checkpoints.is_dir() else None, "step checkpoints")]
    where = [f"{_inside(path, out)}/ ({what})" for path, what in kept if path is not None]
    where += ["metrics.jsonl", "config.yaml"]
    generate, commands = _generate_command(loop.config)
    if final is not None and (adapter is None or merged is not None):  # a Hugging Face model: the run's own
        commands.append(f"{generate} checkpointer.checkpoint_dir={merged or final}")
    elif adapter is not None:  # the adapter on its base, as generate builds it; or merged into it once
        base = run.base_checkpoint or "null"
        commands.append(f"{generate} checkpointer.checkpoint_dir={base} adapter_dir={adapter}")
        if merged is None and run.base_checkpoint is not None:
            commands.append(f"tune merge --base {run.base_checkpoint} --adapter {adapter} --output {out}_merged")
    if checkpoints.is_dir():
        commands.append(f"tune export {out} --output {out}_hf   # the newest step checkpoint as Hugging Face files")
    lines = ["; ".join(done), f"outputs in {out}: {', '.join(where)}"]
    lines += [f"{'next: ' if i == 0 else '      '}{command}" for i, command in enumerate(commands)]
    for line in lines:
        loop.log.print(line)


def _inside(path: Path, folder: Path) -> Path:
    """``path`` relative to ``folder`` where it is inside it, else whole."""
    try:
        return path.relative_to(folder)
    except ValueError:
        return path


def _generate_command(cfg: DictConfig) -> tuple[str, list[str]]:
    """How to generate from this run's model: ``tune run generate --config demo`` where the shipped generate
    config builds it (its builder, or the plain builder a LoRA builder adapts: generate builds the LoRA version
    from an adapter's settings), and otherwise from a copy of that config, made first, given this run's model."""
    shipped = configs_dir() / "generate" / "demo.yaml"
    builder = str(cfg.model.get("_component_", ""))
    plain = re.sub(r"\.q?lora_", ".", builder)
    if shipped.is_file() and OmegaConf.load(shipped).model.get("_component_") in (builder, plain):
        return "tune run generate --config demo", []
    copy = "tune cp generate/demo my_generate.yaml   # then set its model and tokenizer to this run's"
    return "tune run generate --config my_generate.yaml", [copy]
