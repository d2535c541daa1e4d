"""Choosing how a run spreads over its devices from the memory estimate (:mod:`toolkit.planning.memory`):
``data_parallel: auto``, ``tensor_parallel: auto`` and ``micro_batch_size: auto`` (:func:`plan_parallelism`, which
the recipes call), and the candidates and reasons ``tune plan`` prints.

The plan is the one place a run's degrees (``tensor_parallel``, ``expert_parallel``, ``context_parallel``) are
given: it returns the layout they make (:attr:`ParallelPlan.dims`, a :class:`~toolkit.parallel.ParallelDims`
checked by :func:`~toolkit.parallel.parallel_dims`), from which the recipe builds its device mesh.

Each choice is the least-communicating layout whose estimate fits a share (``headroom``) of the device, and says in
one line which numbers it was made from; where nothing fits, one error names the smallest estimate and what to
change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.parallel.expert_parallel import check_expert_parallel
from toolkit.parallel.mesh import (
    SHARDED_STRATEGIES,
    ParallelDims,
    expert_parallel_problems,
    parallel_dims,
    tensor_parallel_problems,
)
from toolkit.parallel.tensor_parallel import check_tensor_parallel
from toolkit.training.accumulation import gradient_accumulation_steps, micro_batch_within_share
from toolkit.training.activations import checkpoint_interval
from toolkit.planning.memory import ROWS, MemoryEstimate, StepKernels, estimate_memory, format_bytes

# --- Choosing a strategy -------------------------------------------------------------------------------------------


def candidate_strategies(*, world_size: int, num_nodes: int = 1, cpu_offload: bool = True) -> list[tuple[str, bool]]:
    """``(strategy, cpu_offload)`` pairs in the order ``auto`` tries them: least communication first.

    - ``ddp``: one bucketed gradient all-reduce per step, overlapped with backward; nothing else.
    - ``zero1``: the same all-reduce, then each rank broadcasts the parameters it updated; no per-layer traffic.
    - ``zero2``: a reduce-scatter of gradients and one all-gather of parameters per layer and step (about DDP's
      volume, in many smaller collectives).
    - ``hsdp`` (several nodes only): ZeRO-3's traffic stays on the fast links inside a node, and only an
      all-reduce of each rank's 1/shard_size of the gradients crosses nodes, where ``zero3`` sends its 1.5x-DDP
      volume of all-gathers and reduce-scatters over the slow inter-node links too. It shards only within a
      node, so it needs more memory than ``zero3``: it goes between ``zero2`` and ``zero3``.
    - ``zero3``: parameters gathered twice per step (forward and backward).
    - with ``cpu_offload``, in the same order: every step also copies parameters and gradients over PCIe and runs
      the optimizer on the CPU, far slower than any collective, so these come last. Their device memory barely
      depends on the shard count, so ``hsdp``'s variant (less inter-node traffic) is tried before ``zero3``'s.

    One process has nothing to shard over (``apply_data_parallel`` leaves the model as it is): only ``ddp``.
    ``cpu_offload=False`` leaves out the offloaded variants: training on the CPU has no device memory to offload
    from, and ``parallel_dims`` refuses ``cpu_offload`` there.
    """
    if world_size == 1:
        return [("ddp", False)]
    sharded = ["zero2", *(["hsdp"] if num_nodes > 1 else []), "zero3"]
    offloaded = [(s, True) for s in sharded] if cpu_offload else []
    return [("ddp", False), ("zero1", False), *((s, False) for s in sharded), *offloaded]


def choose_strategy(
    model: nn.Module,
    *,
    device_memory_bytes: int,
    world_size: int,
    num_nodes: int = 1,
    micro_batch_size: int,
    max_seq_len: int,
    dtype: str = "bf16-mixed",
    activation_checkpointing: bool | int = False,
    activation_offloading: bool = False,
    trainable_params: int | None = None,
    optimizer: str = "adamw",
    optimizer_in_backward: bool = False,
    gradient_accumulation_steps: int = 1,
    headroom: float = 0.9,
    kernels: StepKernels = StepKernels(),
    cpu_offload: bool = True,
    shard_size: int | None = None,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
) -> tuple[str, MemoryEstimate, str]:
    """The cheapest strategy (order: :func:`candidate_strategies`) whose estimate fits ``headroom`` of the device.

    The other arguments are those of :func:`estimate_memory` (``shard_size``: HSDP's, the config's
    ``hsdp_shard_size``, with which the run shards if ``hsdp`` is picked; ``world_size``: the data-parallel ranks,
    all processes over ``tensor_parallel``). With ``optimizer_in_backward`` on several processes, only the FSDP2
    strategies are candidates (see :mod:`toolkit.optim.optimizers`); with ``cpu_offload=False`` (training on the
    CPU), no offloaded one is; with ``tensor_parallel`` > 1, none that cannot combine with it (``zero1``,
    ``cpu_offload``); with ``expert_parallel`` > 1, only ``zero2`` and ``zero3`` without offloading.

    Returns:
        ``(strategy, estimate, reason)``: the ``data_parallel`` value, its estimate (``estimate.cpu_offload`` says
        whether to set ``cpu_offload: true``) and a one-line reason naming the numbers.

    Raises:
        UserError: nothing fits; the message gives the smallest estimate and what to change.
    """
    usable = int(headroom * device_memory_bytes)
    budget = f"{format_bytes(usable)} usable ({headroom:.0%} of {format_bytes(device_memory_bytes)})"
    estimates = []
    for strategy, offload in candidate_strategies(world_size=world_size, num_nodes=num_nodes, cpu_offload=cpu_offload):
        if optimizer_in_backward and world_size > 1 and strategy not in SHARDED_STRATEGIES and tensor_parallel == 1:
            continue
        if tensor_parallel_problems(
            tensor_parallel=tensor_parallel, world_size=None, strategy=strategy, cpu_offload=offload
        ) or expert_parallel_problems(
            expert_parallel=expert_parallel, world_size=None, strategy=strategy, cpu_offload=offload
        ):
            continue
        estimate = estimate_memory(
            model,
            strategy=strategy,
            world_size=world_size,
            num_nodes=num_nodes,
            micro_batch_size=micro_batch_size,
            max_seq_len=max_seq_len,
            dtype=dtype,
            activation_checkpointing=activation_checkpointing,
            activation_offloading=activation_offloading,
            cpu_offload=offload,
            trainable_params=trainable_params,
            optimizer=optimizer,
            optimizer_in_backward=optimizer_in_backward,
            gradient_accumulation_steps=gradient_accumulation_steps,
            kernels=kernels,
            shard_size=shard_size,
            tensor_parallel=tensor_parallel,
            expert_parallel=expert_parallel,
        )
        if estimate.total <= usable:
            rejected = "".join(f"; {e.label} would need {format_bytes(e.total)}" for e in estimates)
            reason = f"{estimate.label} needs {format_bytes(estimate.total)} per device of {budget}{rejected}"
            return strategy, estimate, reason
        estimates.append(estimate)
    raise UserError(_nothing_fits(min(estimates, key=lambda e: e.total), budget, world_size, micro_batch_size,
                                  _activation_fixes(activation_checkpointing, activation_offloading)))


# --- Choosing a tensor-parallel degree too (``tensor_parallel: auto``) ----------------------------------------------


def tensor_parallel_degrees(model: nn.Module, *, processes_per_node: int) -> list[int]:
    """The tensor-parallel degrees a run may use: divisors of the processes of one node (a TP group's all-reduces,
    four per layer and step, must stay on a node's fast links) that split the model's heads, key/value heads, MLP
    width and vocabulary (:func:`~toolkit.parallel.tensor_parallel.check_tensor_parallel`), smallest first; 1 always.
    """
    return _degrees(processes_per_node, lambda tp: check_tensor_parallel(model, tp=tp))


def expert_parallel_degrees(model: nn.Module, *, data_parallel_size: int) -> list[int]:
    """The expert-parallel degrees a run of ``model`` may use: divisors of its data-parallel processes that share
    out its experts evenly (:func:`~toolkit.parallel.expert_parallel.check_expert_parallel`), smallest first; 1
    always (the only one for a model without experts)."""
    return _degrees(data_parallel_size, lambda ep: check_expert_parallel(model, ep=ep))


def _degrees(processes: int, check: Callable[[int], None]) -> list[int]:
    # 1, and the divisors of `processes` that `check` does not refuse.
    degrees = [1]
    for degree in range(2, processes + 1):
        if processes % degree:
            continue
        try:
            check(degree)
        except UserError:
            continue
        degrees.append(degree)
    return degrees


def candidate_layouts(
    *, world_size: int, num_nodes: int = 1, degrees: Sequence[int] = (1,), cpu_offload: bool = True
) -> list[tuple[str, bool, int]]:
    """``(strategy, cpu_offload, tensor_parallel)`` in the order ``tensor_parallel: auto`` tries them, over
    ``world_size`` processes: least communication first.

    - no tensor parallelism, the strategies of :func:`candidate_strategies` without offloading: at most one
      collective per layer and step, overlapped with compute;
    - then each degree of ``degrees`` above 1, smallest first, with the strategies over the ``world_size /
      degree`` data-parallel ranks that combine with it (not ``zero1``): every layer waits on an all-reduce in
      forward and backward, within a node, and a larger degree cuts the matmuls finer;
    - last, offloading without tensor parallelism (it cannot combine with it yet): every step copies state over
      PCIe and runs the optimizer on the CPU, slower than any collective.
    """
    plain = [(s, False, 1) for s, offload in candidate_strategies(world_size=world_size, num_nodes=num_nodes)
             if not offload]
    split = [
        (s, False, tp)
        for tp in degrees if tp > 1 and world_size % tp == 0
        for s, offload in candidate_strategies(world_size=world_size // tp, num_nodes=num_nodes)
        if not offload and s != "zero1"
    ]
    offloaded = [(s, True, 1) for s, offload in candidate_strategies(world_size=world_size, num_nodes=num_nodes)
                 if offload] if cpu_offload else []
    return ([*plain] if 1 in degrees else []) + split + (offloaded if 1 in degrees else [])


def choose_layout(
    model: nn.Module,
    *,
    device_memory_bytes: int,
    world_size: int,
    num_nodes: int = 1,
    degrees: Sequence[int],
    strategy: str = "auto",
    cpu_offload: bool = True,
    batch_size: int | None,
    micro_batch_size: int | str,
    max_seq_len: int,
    dtype: str = "bf16-mixed",
    activation_checkpointing: bool | int = False,
    activation_offloading: bool = False,
    optimizer: str = "adamw",
    optimizer_in_backward: bool = False,
    headroom: float = 0.9,
    kernels: StepKernels = StepKernels(),
    shard_size: int | None = None,
    expert_parallel: int = 1,
) -> tuple[str, int, MemoryEstimate, str]:
    """``tensor_parallel: auto``: the first layout of :func:`candidate_layouts` (the strategy given, or every one
    with ``strategy="auto"``) whose estimate fits ``headroom`` of the device.

    Args:
        world_size: all processes; a degree ``t`` leaves ``world_size / t`` data-parallel ranks.
        degrees: the degrees to try (:func:`tensor_parallel_degrees`).
        strategy: the configured ``data_parallel``, or ``auto``.
        cpu_offload: with a given strategy, the configured ``cpu_offload``; with ``auto``, whether offloaded
            layouts are candidates (not on a CPU).
        batch_size: the global batch; a degree whose data-parallel ranks it does not split over is skipped
            (``None``: not checked, ``micro_batch_size`` used as it is).
        micro_batch_size: sequences per micro batch, cut to each layout's share of ``batch_size`` as the run cuts
            it; ``auto``: 1, or the whole share with ``optimizer_in_backward`` (which cannot accumulate).
        expert_parallel: the configured degree (``zero2``/``zero3`` without tensor parallelism or offloading only:
            the layouts that cannot combine with it are not tried).
        The others: as in :func:`estimate_memory` (``shard_size`` in data-parallel ranks).

    Returns:
        ``(strategy, tensor_parallel, estimate, reason)``: the reason is one line naming the layout, its bytes, the
        budget and the smallest estimate of each degree tried before it.

    Raises:
        UserError: no layout fits (naming ``tensor_parallel``, the smallest layout and its numbers).
    """
    usable = int(headroom * device_memory_bytes)
    budget = f"{format_bytes(usable)} usable ({headroom:.0%} of {format_bytes(device_memory_bytes)})"
    if strategy == "auto":
        layouts = candidate_layouts(world_size=world_size, num_nodes=num_nodes, degrees=degrees,
                                    cpu_offload=cpu_offload)
    else:
        layouts = [(strategy, cpu_offload, tp) for tp in degrees if not tensor_parallel_problems(
            tensor_parallel=tp, world_size=world_size, strategy=strategy, cpu_offload=cpu_offload)]
    smallest: dict[int, MemoryEstimate] = {}  # per degree tried, its smallest estimate
    for layout_strategy, offload, tp in layouts:
        dp = world_size // tp
        if optimizer_in_backward and dp > 1 and tp == 1 and layout_strategy not in SHARDED_STRATEGIES:
            continue  # DDP and ZeRO-1 cannot step inside backward (ddp under TP runs on FSDP2, which can)
        if expert_parallel_problems(
            expert_parallel=expert_parallel, world_size=dp, strategy=layout_strategy, tensor_parallel=tp,
            cpu_offload=offload,
        ):
            continue
        if batch_size is not None and (batch_size < 1 or batch_size % dp):
            continue  # the global batch does not split over this layout's data-parallel ranks
        if micro_batch_size == "auto":
            whole = optimizer_in_backward and batch_size is not None
            micro = batch_size // dp if whole else 1
        elif batch_size is not None:
            micro = micro_batch_within_share(batch_size=batch_size, micro_batch_size=micro_batch_size, world_size=dp)
        else:
            micro = micro_batch_size
        if batch_size is not None and batch_size % (dp * micro):
            continue
        steps = 1 if batch_size is None else batch_size // (dp * micro)
        try:
            estimate = estimate_memory(
                model, strategy=layout_strategy, world_size=dp, num_nodes=num_nodes, micro_batch_size=micro,
                max_seq_len=max_seq_len, dtype=dtype, activation_checkpointing=activation_checkpointing,
                activation_offloading=activation_offloading, cpu_offload=offload, optimizer=optimizer,
                optimizer_in_backward=optimizer_in_backward, shard_size=shard_size,
                gradient_accumulation_steps=steps, kernels=kernels, tensor_parallel=tp, expert_parallel=expert_parallel,
            )
        except UserError:  # a shape this degree cannot take (hsdp_shard_size over fewer data-parallel ranks)
            continue
        if estimate.total <= usable:
            before = "".join(
                f"; {'without tensor parallelism' if t == 1 else f'at tp{t}'} the smallest, {e.label}, would need "
                f"{format_bytes(e.total)}"
                for t, e in smallest.items() if t != tp
            )
            reason = f"{estimate.label} needs {format_bytes(estimate.total)} per device of {budget}{before}"
            return layout_strategy, tp, estimate, reason
        if tp not in smallest or estimate.total < smallest[tp].total:
            smallest[tp] = estimate
    if not smallest:
        raise UserError(
            f"tensor_parallel: auto: no layout of {world_size} process(es) takes batch_size {batch_size} with "
            f"degrees {', '.join(map(str, degrees))}; choose a batch_size that is a multiple of {world_size}"
        )
    best = min(smallest.values(), key=lambda e: e.total)
    parts = ", ".join(
        f"{title} {format_bytes(getattr(best, attribute))}"
        for title, attribute in ROWS[:-1]
        if getattr(best, attribute) >= 0.01 * best.total
    )
    fixes = _activation_fixes(activation_checkpointing, activation_offloading)
    if micro_batch_size not in ("auto", 1):
        fixes.append(f"a smaller micro_batch_size (now {micro_batch_size})")
    fixes += ["a shorter max_seq_len", "LoRA/QLoRA", f"more than {world_size} GPU(s)"]
    tried = ", ".join(str(t) for t in smallest)
    raise UserError(
        f"tensor_parallel: auto: no layout of {world_size} process(es) fits {budget} (degrees tried: {tried}, within "
        f"a node): the smallest, {best.label}, needs {format_bytes(best.total)} per device ({parts}); try "
        f"{', '.join(fixes)}"
    )


def _activation_fixes(activation_checkpointing: bool | int, activation_offloading: bool) -> list[str]:
    """The activation memory switches not yet fully on, as overrides to suggest."""
    fixes = [] if checkpoint_interval(activation_checkpointing) == 1 else ["activation_checkpointing=true"]
    return fixes + ([] if activation_offloading else ["activation_offloading=true"])


def _nothing_fits(
    smallest: MemoryEstimate, budget: str, world_size: int, micro_batch_size: int, activation_fixes: list[str]
) -> str:
    # The parts worth acting on (a few MiB of buffers would only be noise).
    parts = ", ".join(
        f"{title} {format_bytes(getattr(smallest, attribute))}"
        for title, attribute in ROWS[:-1]
        if getattr(smallest, attribute) >= 0.01 * smallest.total
    )
    fixes = list(activation_fixes)
    if micro_batch_size > 1:
        fixes.append(f"a smaller micro_batch_size (now {micro_batch_size})")
    fixes += ["a shorter max_seq_len", "LoRA/QLoRA instead of a full fine-tune", f"more than {world_size} GPU(s)"]
    return (
        f"no data-parallel strategy fits {world_size} device(s) with {budget}: the smallest, {smallest.label}, "
        f"needs {format_bytes(smallest.total)} per device ({parts}); try {', '.join(fixes)}"
    )


def device_memory_bytes(device: torch.device | str | int) -> int | None:
    """Total memory of a CUDA device in bytes; ``None`` for other devices (state it then, e.g. ``device_memory_gb``)."""
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)



@dataclass(frozen=True)
class ParallelPlan:
    """How a run spreads over its devices, with ``auto`` values resolved.

    Attributes:
        dims: the layout: the ``data_parallel`` strategy, whether sharded state is offloaded to host memory, and
            every degree (tensor, context, expert parallel), checked against the job. The recipe builds its mesh
            from it (:meth:`~toolkit.parallel.ParallelDims.build_mesh`); nothing states the degrees a second time.
        micro_batch_size: sequences per device per forward/backward.
        accumulation_steps: micro-steps per optimizer step (``batch_size = batch-reading ranks x micro x steps``).
        reasons: one line per ``auto`` decision or cut micro batch, naming the numbers it was made from.
    """

    dims: ParallelDims
    micro_batch_size: int
    accumulation_steps: int
    reasons: tuple[str, ...] = ()


def plan_parallelism(
    *,
    model: nn.Module,
    strategy: str,
    cpu_offload: bool,
    batch_size: int,
    micro_batch_size: int | str,
    device: torch.device,
    device_memory_gb: float | None,
    world_size: int,
    local_world_size: int,
    max_seq_len: int,
    dtype: str,
    activation_checkpointing: bool | int,
    activation_offloading: bool = False,
    optimizer_in_backward: bool = False,
    headroom: float = 0.9,
    kernels: StepKernels = StepKernels(),
    shard_size: int | None = None,
    optimizer: str = "adamw",
    offload_candidates: bool | None = None,
    tensor_parallel: int | str = 1,
    expert_parallel: int = 1,
    context_parallel: int = 1,
    rank: int = 0,
) -> ParallelPlan:
    """Resolve ``tensor_parallel: auto``, ``data_parallel: auto`` and ``micro_batch_size: auto`` from the memory
    estimate.

    ``tensor_parallel: auto`` picks the least-communicating layout that fits (:func:`choose_layout`): no tensor
    parallelism if a strategy without offloading fits, else the smallest degree within a node that does, else
    offloading; with ``data_parallel`` given, only the degree is chosen.
    ``data_parallel: auto`` picks the least-communicating strategy whose estimate fits ``headroom`` of the device
    at the configured micro batch (at 1 when that is ``auto`` too), never one with ``cpu_offload`` on a CPU.
    ``micro_batch_size: auto`` then picks the largest micro batch that divides this rank's share of ``batch_size``
    (so the global batch, and the training, stay the same) and whose estimate fits; with ``optimizer_in_backward``,
    which cannot accumulate, that share whole or nothing. Given values pass through, checked, except that a micro
    batch above a process's share of ``batch_size`` is cut to that share (:func:`micro_batch_within_share`).

    Args:
        model: the model, on the meta device (only shapes are read).
        strategy, cpu_offload, batch_size, micro_batch_size, max_seq_len, dtype, activation_checkpointing,
            activation_offloading, optimizer_in_backward: as in the config (offloading is counted as on a GPU: on
            the CPU, where it does nothing, host and device memory are the same).
        kernels: the attention and loss kernels the step runs, from the config's ``flex_attention`` (resolved),
            ``loss_chunks`` and ``fused_loss`` (see :class:`StepKernels`).
        device: this rank's device; its memory is used on CUDA.
        device_memory_gb: the memory to plan for where the device does not say (CPU), in GiB.
        world_size, local_world_size: the job's shape: all processes, and those of one node. The batch and the
            data-parallel strategy span ``world_size / tensor_parallel`` of them.
        headroom: the fraction of device memory a plan may fill.
        shard_size: HSDP's shard group size as the run will use it (config ``hsdp_shard_size``, in data-parallel
            ranks; default: those of one node); the estimate of an ``hsdp`` plan depends on it.
        optimizer: the memory model of the run's optimizer (:func:`optimizer_memory_model`), whose state the
            estimate counts.
        offload_candidates: whether ``data_parallel: auto`` may pick ``cpu_offload``; default: on any device but
            the CPU (``tune plan``, which plans for GPUs from a CPU, says true).
        tensor_parallel: the config's ``tensor_parallel``: a degree, or ``auto``.
        expert_parallel: the config's ``expert_parallel``, which every estimate counts (and which only ``zero2`` and
            ``zero3`` without tensor parallelism or offloading combine with).
        context_parallel: the config's ``context_parallel``: the batch splits over the data-parallel ranks over it
            (the ranks of a CP group share their samples), and each rank's activations are those of
            ``max_seq_len / context_parallel`` positions.
        rank: this process's global rank, which the layout (:attr:`ParallelPlan.dims`) places in the mesh.

    Returns:
        The plan, whose ``dims`` is the layout of these degrees and the chosen strategy, checked against the job as
        :func:`~toolkit.parallel.parallel_dims` checks it (on the device planned for: ``offload_candidates``
        plans for a GPU).

    Raises:
        UserError: ``auto`` without a known device memory, nothing fits, sizes that do not divide, an invalid
            ``activation_checkpointing``, or a layout :func:`~toolkit.parallel.parallel_dims` refuses.
    """
    checkpoint_interval(activation_checkpointing)  # refused here, before any weight is loaded

    def layout(strategy: str, cpu_offload: bool, tensor_parallel: int) -> ParallelDims:
        # `tune plan` plans for GPUs from wherever it runs (offload_candidates): its layout is checked as on one.
        return parallel_dims(
            strategy=strategy, world_size=world_size, local_world_size=local_world_size, shard_size=shard_size,
            cpu_offload=cpu_offload, device_type="cuda" if offload_candidates else device.type,
            tensor_parallel=tensor_parallel, rank=rank, expert_parallel=expert_parallel,
            context_parallel=context_parallel,
        )

    auto_batch = micro_batch_size == "auto"
    auto_tp = tensor_parallel == "auto"
    if not auto_batch and not isinstance(micro_batch_size, int):
        raise UserError(f"micro_batch_size: must be a positive integer or auto, got {micro_batch_size!r}")
    if not auto_tp and (isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int)
                        or tensor_parallel < 1):
        raise UserError(f"tensor_parallel: must be a positive integer or auto, got {tensor_parallel!r}")
    tp = 1 if auto_tp else tensor_parallel
    if world_size % tp:
        raise UserError(f"tensor_parallel: {tp} does not divide the {world_size} processes")
    num_nodes = max(1, world_size // max(1, local_world_size))
    reasons = []
    if (auto_batch or auto_tp) and context_parallel > 1:
        raise UserError(f"{'micro_batch_size' if auto_batch else 'tensor_parallel'}: auto cannot combine with "
                        f"context_parallel={context_parallel} yet; give it a number")
    batch_world = world_size // tp // context_parallel  # ranks reading distinct samples
    if not auto_batch and not auto_tp:
        given = micro_batch_size
        micro_batch_size = micro_batch_within_share(
            batch_size=batch_size, micro_batch_size=given, world_size=batch_world
        )
        if micro_batch_size != given:
            reasons.append(
                f"micro_batch_size: {given} -> {micro_batch_size}, each process's share of batch_size {batch_size} "
                f"on {batch_world} {'processes' if batch_world == world_size else 'data-parallel ranks'}"
            )
    if strategy != "auto" and not auto_batch and not auto_tp:
        steps = gradient_accumulation_steps(
            batch_size=batch_size, micro_batch_size=micro_batch_size, world_size=batch_world
        )
        return ParallelPlan(layout(strategy, cpu_offload, tp), micro_batch_size, steps, tuple(reasons))
    memory = device_memory_bytes(device)
    if memory is None:
        if device_memory_gb is None:
            what = ("tensor_parallel: auto" if auto_tp else "data_parallel: auto" if strategy == "auto"
                    else "micro_batch_size: auto")
            raise UserError(
                f"{what} needs the memory of each device; on CPU set device_memory_gb=<GiB> "
                "(or give the value: data_parallel ddp, zero1, zero2, zero3 or hsdp; micro_batch_size and "
                "tensor_parallel a number)"
            )
        memory = int(device_memory_gb * 2**30)
    offload = device.type != "cpu" if offload_candidates is None else offload_candidates
    # Under context parallelism each rank holds max_seq_len / cp positions of every row.
    common = dict(max_seq_len=-(-max_seq_len // context_parallel), dtype=dtype,
                  activation_checkpointing=activation_checkpointing, activation_offloading=activation_offloading,
                  optimizer_in_backward=optimizer_in_backward, kernels=kernels, shard_size=shard_size,
                  optimizer=optimizer, expert_parallel=expert_parallel)
    if auto_tp:
        given_strategy = strategy != "auto"
        strategy, tp, estimate, reason = choose_layout(
            model, device_memory_bytes=memory, world_size=world_size, num_nodes=num_nodes,
            degrees=tensor_parallel_degrees(model, processes_per_node=max(1, local_world_size)),
            strategy=strategy, cpu_offload=cpu_offload if given_strategy else offload, batch_size=batch_size,
            micro_batch_size=micro_batch_size, headroom=headroom, **common,
        )
        cpu_offload = estimate.cpu_offload
        if given_strategy:
            reasons.append(f"tensor_parallel: auto -> {tp} ({reason})")
        else:
            reasons.append(f"data_parallel, tensor_parallel: auto -> {strategy}"
                           f"{' with cpu_offload' if cpu_offload else ''}, tensor_parallel {tp} ({reason})")
    dp_world = world_size // tp  # what the strategy shards over (context-parallel ranks among them)
    batch_world = dp_world // context_parallel  # (tp may have been chosen since)
    micro = micro_batch_size
    if auto_batch:
        # The step inside backward takes this rank's share of the batch at once (it cannot accumulate).
        whole = optimizer_in_backward and batch_size >= dp_world and batch_size % dp_world == 0
        micro = batch_size // dp_world if whole else 1
    else:
        given = micro_batch_size
        micro = micro_batch_within_share(batch_size=batch_size, micro_batch_size=given, world_size=batch_world)
        if auto_tp and micro != given:
            reasons.append(
                f"micro_batch_size: {given} -> {micro}, each process's share of batch_size {batch_size} on "
                f"{dp_world} data-parallel ranks"
            )
    steps = gradient_accumulation_steps(batch_size=batch_size, micro_batch_size=micro, world_size=batch_world)
    if strategy == "auto":
        strategy, estimate, reason = choose_strategy(
            model, device_memory_bytes=memory, world_size=dp_world, num_nodes=num_nodes, micro_batch_size=micro,
            gradient_accumulation_steps=steps, headroom=headroom, cpu_offload=offload, tensor_parallel=tp, **common,
        )
        cpu_offload = estimate.cpu_offload
        reasons.append(f"data_parallel: auto -> {reason}")
    if auto_batch:
        micro, steps, reason = _largest_micro_batch(
            model, strategy=strategy, cpu_offload=cpu_offload, batch_size=batch_size, num_nodes=num_nodes,
            usable=int(headroom * memory), world_size=dp_world, tensor_parallel=tp, **common,
        )
        reasons.append(f"micro_batch_size: auto -> {reason}")
    return ParallelPlan(layout(strategy, cpu_offload, tp), micro, steps, tuple(reasons))


def _largest_micro_batch(
    model: nn.Module, *, strategy: str, cpu_offload: bool, batch_size: int, world_size: int, num_nodes: int,
    usable: int, **common,
) -> tuple[int, int, str]:
    if batch_size < 1 or batch_size % world_size:
        raise UserError(
            f"batch_size: {batch_size} must be a positive multiple of the number of processes ({world_size})"
        )
    per_rank = batch_size // world_size
    # The step inside backward cannot accumulate: this rank's share of the batch in one micro batch, or nothing.
    divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    candidates = [per_rank] if common["optimizer_in_backward"] else divisors
    for micro in sorted(candidates, reverse=True):
        estimate = estimate_memory(
            model, strategy=strategy, num_nodes=num_nodes, cpu_offload=cpu_offload, micro_batch_size=micro,
            gradient_accumulation_steps=per_rank // micro, world_size=world_size, **common,
        )
        if estimate.total <= usable:
            return micro, per_rank // micro, (
                f"{micro} sequences per device ({per_rank // micro} accumulation step(s)): {estimate.label} needs "
                f"{format_bytes(estimate.total)} of {format_bytes(usable)} usable"
            )
    fixes = _activation_fixes(common["activation_checkpointing"], common["activation_offloading"]) + [
        "a shorter max_seq_len", "a sharded data_parallel strategy", "LoRA/QLoRA"]
    if common["optimizer_in_backward"]:
        raise UserError(
            f"micro_batch_size: auto: optimizer_in_backward cannot accumulate gradients, so each process takes its "
            f"{per_rank} sequences of the batch at once, and {per_rank} sequences of {common['max_seq_len']} tokens "
            f"do not fit {format_bytes(usable)} per device under {strategy} (needs {format_bytes(estimate.total)}); "
            f"try a smaller batch_size, {', '.join(fixes)}, or optimizer_in_backward=false"
        )
    raise UserError(
        f"micro_batch_size: auto: not even 1 sequence of {common['max_seq_len']} tokens fits {format_bytes(usable)} "
        f"per device under {strategy} (needs {format_bytes(estimate.total)}); try {', '.join(fixes)}"
    )
