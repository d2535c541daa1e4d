"""How much device memory a training step needs under each data-parallel strategy, and the cheapest strategy that
fits (``data_parallel: auto`` and ``tune plan``).

The estimate is an analytic count, per device, of what :mod:`toolkit.parallel` and
:mod:`toolkit.training.precision` allocate for a :class:`~toolkit.modules.TransformerDecoder` built on the meta
device (so a 70B model costs nothing to plan):

- **params**: stored (master) parameters, NF4 base weights (QLoRA) at their quantized size, plus buffers such
  as the rotary cos/sin cache.
- **grads**: gradients in the stored dtype (the mixed modes reduce in fp32); with the optimizer step inside
  backward, only the largest parameter's (each gradient is freed as soon as its parameter has stepped).
- **optimizer state**: ``states x`` trainable parameters in the stored dtype (AdamW: exp_avg and exp_avg_sq), or
  in one byte each for torchao's 8-bit Adam(W).
- **activations**: tensors autograd saves for backward, from the formula in
  :func:`~toolkit.training.activation_memory.activation_bytes`.
- **logits**: the peak of the logits and the loss's float32 copies, see
  :func:`~toolkit.training.activation_memory.logits_bytes`.
- **gathered**: full-size parameters and gradients that exist only around compute: FSDP2's unsharded layers and
  their unsharded gradients, or autocast's low-precision copies of the weights (DDP and ZeRO-1 mixed modes).
- **all-to-all**: under expert parallelism, the buffers of tokens the experts' exchange holds while a layer's
  experts run, see :func:`~toolkit.training.activation_memory.all_to_all_bytes`.

The total is the sum. That is the peak at the start of a backward pass with gradient accumulation, when the
previous micro-steps' gradients, the optimizer state, every saved activation and the loss's buffers coexist; with
one micro-step it overestimates by at most the gradients, and under expert parallelism by at most the all-to-all
buffers (they exist while a layer's experts run, not while the loss does). It counts tensors, not the CUDA caching
allocator's rounding and fragmentation, the CUDA context or NCCL's buffers: :func:`choose_strategy` keeps
``1 - headroom`` of the device free for those.

The per-token formulas of the activations and logits, which depend on how the step computes (:class:`StepKernels`)
but not on the strategy, live in :mod:`toolkit.training.activation_memory`; this module adds each strategy's
parameters, gradients, optimizer state and gathered copies, and chooses among the strategies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.modules.peft.nf4_experts import has_nf4
from toolkit.parallel.expert_parallel import check_expert_parallel, expert_parallel_local_parameters
from toolkit.parallel.mesh import ONE_PROCESS_OFFLOAD, expert_parallel_problems, tensor_parallel_problems
from toolkit.parallel.tensor_parallel import check_tensor_parallel
from toolkit.parallel.tp_shapes import tensor_parallel_local_parameters
from toolkit.training.accumulation import gradient_accumulation_steps, micro_batch_within_share
# The activation and logits formulas, also importable from here as they were before they got their own module.
from toolkit.training.activation_memory import (
    _precision,
    activation_bytes,
    all_to_all_bytes,
    logits_bytes,
    offloaded_activation_bytes,
)
from toolkit.training.activations import checkpoint_interval
from toolkit.training.muon import muon_by_default, step_buffer_bytes

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "hsdp")
_SHARDED = ("zero2", "zero3", "hsdp")

# Optimizer state tensors per trainable parameter, each in the stored parameter dtype (but see below).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "adamw8bit": 2, "adam8bit": 2, "muon": 1}
# (Muon: one momentum buffer for its hidden matrices; the AdamW it runs on everything else keeps two. The estimate
# counts each parameter with its own, and the step's transient buffers, see toolkit.training.muon.step_buffer_bytes.)
# Bytes per state element of the optimizers that keep their state in their own format: torchao's 8-bit Adam(W)
# stores one byte per element and a float32 scale per block of 256 (tensors under 4096 elements, a negligible share
# of a model, stay in the parameter dtype).
_STATE_ELEMENT_BYTES = {"adamw8bit": 1 + 4 / 256, "adam8bit": 1 + 4 / 256}

_GIB = 1024**3


def optimizer_memory_model(component: str) -> str | None:
    """The :data:`OPTIMIZER_STATES` name of an optimizer ``_component_`` (``torch.optim.AdamW`` -> ``adamw``,
    ``torchao.optim.AdamW8bit`` -> ``adamw8bit``), or ``None`` when the memory model has none for it."""
    name = component.rsplit(".", 1)[-1].lower()
    return name if name in OPTIMIZER_STATES else None


@dataclass(frozen=True)
class StepKernels:
    """Which kernels a training step's attention and loss run on. They change how much memory the activations and
    the logits take (not the parameters or their state), so the estimate needs them as the recipes run them.

    Attributes:
        flex_attention: attention runs on FlexAttention (config ``flex_attention``, as
            :func:`~toolkit.training.resolve_flex_attention` resolves it; ``tune plan`` counts ``auto`` as on), which
            soft-caps scores inside its kernel: soft-capped layers save no scores (see
            :func:`~toolkit.training.activation_memory.activation_bytes`).
        loss_chunks: the output projection and loss run over this many sequence chunks (config ``loss_chunks``;
            ``None``: whole, see :func:`~toolkit.training.activation_memory.logits_bytes`).
        fused_loss: the projection and loss are fused, so that no chunk's logits outlive it (config ``fused_loss``,
            on by default in the recipes and ``forward_backward``; see
            :func:`~toolkit.training.activation_memory.logits_bytes`).
        sequences_per_sample: rows one sample of the batch becomes (the preference recipe's pairs: 2, chosen and
            rejected in one forward), so activations and logits count ``micro_batch_size`` times this many rows.
        reference_model: a frozen copy of the model scores each batch beside it (full-fine-tuning preference
            tuning with a live reference), laid out as the policy (see :attr:`MemoryEstimate.reference`).
        frozen_model: another frozen model (of its own shape, on the meta device) scores each batch beside it,
            laid out alike: distillation's teacher.
    """

    flex_attention: bool = False
    loss_chunks: int | None = None
    fused_loss: bool = True
    sequences_per_sample: int = 1
    reference_model: bool = False
    frozen_model: nn.Module | None = None


def format_bytes(n: int) -> str:
    """``n`` bytes in GiB (``12.34 GiB``), or in MiB below one GiB."""
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device holds during a training step under one strategy (see the module docstring).

    Attributes:
        strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``hsdp``.
        cpu_offload: sharded parameters, gradients and optimizer state live in host memory.
        dtype: the precision mode (``fp32``, ``bf16``, ``bf16-mixed``, ``fp16-mixed``).
        world_size: data-parallel ranks (all processes over ``tensor_parallel``).
        shard_size: ranks each parameter is sharded over (1 for ddp/zero1, optimizer state aside).
        params, grads, optimizer_state, activations, logits, gathered: per-device bytes.
        host: per-rank bytes of host memory for offloaded state and activations (0 without ``cpu_offload`` or
            ``activation_offloading``); with an NF4 model under ``cpu_offload``, at least the whole quantized model,
            which every rank holds there while it loads.
        tensor_parallel: ranks each layer is split over (the layout is ``world_size x tensor_parallel``
            processes).
        expert_parallel: data-parallel ranks each mixture-of-experts layer's experts are shared out over.
        all_to_all: per-device bytes of the buffers the experts' token exchange holds (0 without expert
            parallelism).
        reference: per-device bytes of a frozen model beside the trained one: the preference recipe's reference
            copy (:attr:`StepKernels.reference_model`) or distillation's teacher (``tune plan``): stored in
            the compute dtype, whole under ddp and zero1, sharded as the parameters under the sharded strategies
            (resharded after every forward, zero2 included), plus what it gathers while it scores (its root unit,
            kept gathered, and a layer and the next one's all-gather buffer).
        loading: per-device bytes while the checkpoint loads, for a model with NF4 weights (QLoRA): every rank
            holds the whole model, quantized, before it is split (``toolkit.training.parallelize``: each weight is
            quantized whole, as on one process); 0 for other models, which are split before they are filled, and
            under ``cpu_offload``, where the whole NF4 model is in ``host`` while it loads.
    """

    strategy: str
    cpu_offload: bool
    dtype: str
    world_size: int
    shard_size: int
    params: int
    grads: int
    optimizer_state: int
    activations: int
    logits: int
    gathered: int
    host: int = 0
    tensor_parallel: int = 1
    expert_parallel: int = 1
    all_to_all: int = 0
    reference: int = 0
    loading: int = 0

    @property
    def label(self) -> str:
        """The layout in a few words: ``zero3``, ``zero3+offload``, ``zero3 x tp2`` or ``zero3 x ep8``."""
        label = f"{self.strategy}+offload" if self.cpu_offload else self.strategy
        if self.expert_parallel > 1:
            return f"{label} x ep{self.expert_parallel}"
        return label if self.tensor_parallel == 1 else f"{label} x tp{self.tensor_parallel}"

    @property
    def temporary(self) -> int:
        """Bytes that exist only during a step: the logits' buffers, gathered parameters/gradients and the
        experts' all-to-all buffers."""
        return self.logits + self.gathered + self.all_to_all

    @property
    def total(self) -> int:
        """Per-device bytes at the peak: the sum of every part during a step, or the load's if that is more."""
        step = self.params + self.grads + self.optimizer_state + self.activations + self.temporary + self.reference
        return max(step, self.loading)

    def table(self) -> str:
        """The estimate as a one-column table (see :func:`format_table`)."""
        return format_table([self])

    def __str__(self) -> str:
        return self.table()


_ROWS = (
    ("params", "params"),
    ("grads", "grads"),
    ("optimizer state", "optimizer_state"),
    ("activations", "activations"),
    ("logits + loss", "logits"),
    ("gathered", "gathered"),
    ("all-to-all", "all_to_all"),
    ("frozen model", "reference"),  # the preference recipe's reference copy, distillation's teacher
    ("loading (whole)", "loading"),  # an NF4 model before it is split
    ("total", "total"),
)


def format_table(estimates: Sequence[MemoryEstimate], *, usable_bytes: int | None = None) -> str:
    """Estimates side by side, one column each, per device, in GiB (MiB when every total is under one GiB).

    Args:
        estimates: the columns.
        usable_bytes: if given, a ``fits`` row says whether each total is within it.
    """
    unit, scale = ("GiB", _GIB) if max(e.total for e in estimates) >= _GIB else ("MiB", 2**20)
    width = max(9, *(len(e.strategy) + 2 for e in estimates))

    def row(title: str, cells: Sequence[str]) -> str:
        return f"{title:<16}" + "".join(f"{cell:>{width}}" for cell in cells)

    lines = [row(f"{unit} per device", [e.strategy for e in estimates])]
    if any(e.cpu_offload for e in estimates):
        lines.append(row("", ["+offload" if e.cpu_offload else "" for e in estimates]))
    for degree, name in (("tensor_parallel", "tp"), ("expert_parallel", "ep")):
        if any(getattr(e, degree) > 1 for e in estimates):
            lines.append(row("", [f"x {name}{getattr(e, degree)}" if getattr(e, degree) > 1 else ""
                                  for e in estimates]))
    shown = {"all_to_all": any(e.expert_parallel > 1 for e in estimates),
             "reference": any(e.reference for e in estimates), "loading": any(e.loading for e in estimates)}
    for title, attribute in _ROWS:
        if shown.get(attribute, True):  # not a row of zeros without expert parallelism or a reference
            lines.append(row(title, [f"{getattr(e, attribute) / scale:.2f}" for e in estimates]))
    if usable_bytes is not None:
        lines.append(row("fits", ["yes" if e.total <= usable_bytes else "no" for e in estimates]))
    if any(e.host for e in estimates):
        lines.append(row("host, per rank", [f"{e.host / scale:.2f}" for e in estimates]))
    return "\n".join(lines)


# --- Parameters, sharding and the estimate -----------------------------------------------------------------------


def _is_subclass(t: torch.Tensor) -> bool:
    # Tensor subclasses that store their data in inner tensors (torchao's NF4 for QLoRA's frozen base).
    return type(t.data) is not torch.Tensor and hasattr(t.data, "__tensor_flatten__")


def _stored_bytes(t: torch.Tensor, element_bytes: int, shards: int = 1) -> int:
    """Bytes of ``t``'s shard on the rank holding the most: ``element_bytes`` per element, except for tensor
    subclasses, which keep their own format (NF4: 4 bits and a scaler per block) whatever the dtype policy, and
    integer tensors (the codes and scales of NF4 experts), which keep their dtype."""
    if _is_subclass(t):
        names, _ = t.data.__tensor_flatten__()
        inner = sum(getattr(t.data, name).numel() * getattr(t.data, name).element_size() for name in names)
        return math.ceil(inner / shards)
    if not t.dtype.is_floating_point:  # integers (NF4 experts' codes and scales) keep their dtype
        element_bytes = t.element_size()
    if t.dim() == 0 or shards == 1:
        return t.numel() * element_bytes
    # FSDP2 shards dim 0 and pads it to a multiple of the shard count: every rank holds ceil(rows / shards) rows.
    rows = t.shape[0]
    return math.ceil(rows / shards) * (t.numel() // max(rows, 1)) * element_bytes


def _largest_greedy_partition(sizes: list[int], parts: int) -> int:
    # ZeroRedundancyOptimizer gives each parameter, largest first, to the rank with the fewest elements so far;
    # the busiest rank sets the memory every rank must have.
    loads = [0] * parts
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return max(loads)


def _check_shape(strategy: str, world_size: int, num_nodes: int, shard_size: int | None, cpu_offload: bool) -> int:
    """The shard group size, after checking the job's shape (the same rules as ``parallel.parallel_dims``)."""
    if strategy not in STRATEGIES:
        hint = "; choose_strategy() resolves auto" if strategy == "auto" else ""
        raise UserError(f"data_parallel: unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}{hint}")
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise UserError(f"a world size of {world_size} cannot be spread evenly over {num_nodes} node(s)")
    if cpu_offload and strategy not in _SHARDED:
        raise UserError(f"cpu_offload: needs a sharded strategy ({', '.join(_SHARDED)}), not data_parallel={strategy}")
    if cpu_offload and world_size == 1:
        raise UserError(ONE_PROCESS_OFFLOAD)
    if strategy in ("ddp", "zero1"):
        return 1
    if strategy != "hsdp":
        return world_size
    shard = shard_size or world_size // num_nodes
    if shard < 1 or world_size % shard:
        raise UserError(f"hsdp_shard_size: a world size of {world_size} cannot be split into shard groups of {shard}")
    return shard


def _frozen_copy_bytes(
    model: nn.Module, *, compute: int, sharded: bool, shards: int, cpu_offload: bool, tensor_parallel: int,
    expert_parallel: int,
) -> tuple[int, int]:
    """Per-device and host bytes of a frozen ``model`` scoring beside the trained one and laid out as it is: in the
    compute dtype (``compute`` bytes an element), its tensor- and expert-parallel shards; whole unless FSDP2
    shards it (``sharded`` over ``shards`` ranks), when it also holds its root unit gathered and, while it scores,
    a layer's units and the next one's all-gather buffer, its shards offloaded to the host with the trained
    model's under ``cpu_offload``."""
    split_experts = expert_parallel_local_parameters(model, ep=expert_parallel)
    local = {**tensor_parallel_local_parameters(model, tp=tensor_parallel), **split_experts}
    experts = {id(t) for t in split_experts.values()}
    params = [local[id(t)] for t in model.parameters()]
    layers = [[local[id(t)] for t in layer.parameters()] for layer in model.layers]
    layer_ids = {id(t) for layer in layers for t in layer}

    def copies(tensors: list[torch.Tensor]) -> int:
        return sum(_stored_bytes(t, compute) for t in tensors)

    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    if not sharded:
        return copies(params) + buffer_bytes, 0
    stored = sum(_stored_bytes(t, compute, shards // expert_parallel if id(t) in experts else shards) for t in params)
    in_use = copies([t for t in params if id(t) not in layer_ids]) + 2 * max(map(copies, layers), default=0)
    return (in_use + buffer_bytes, stored) if cpu_offload else (in_use + buffer_bytes + stored, 0)


def estimate_memory(
    model: nn.Module,
    *,
    strategy: str,
    world_size: int,
    num_nodes: int = 1,
    micro_batch_size: int,
    max_seq_len: int,
    dtype: str = "bf16-mixed",
    activation_checkpointing: bool | int = False,
    activation_offloading: bool = False,
    cpu_offload: bool = False,
    trainable_params: int | None = None,
    optimizer: str = "adamw",
    optimizer_in_backward: bool = False,
    shard_size: int | None = None,
    gradient_accumulation_steps: int = 1,
    kernels: StepKernels = StepKernels(),
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
) -> MemoryEstimate:
    """Per-device memory of one training step of ``model`` under ``strategy`` (see the module docstring).

    Per strategy, with ``N`` parameters, ``T`` trainable, ``W`` ranks and ``S`` the shard group size (``W``; HSDP:
    ranks per node, or ``shard_size``):

    - ``ddp``: everything replicated. Mixed modes run under autocast, which holds a compute-dtype copy of every
      matmul weight from forward to backward (``gathered``).
    - ``zero1``: as ``ddp``, but ZeroRedundancyOptimizer keeps each parameter's optimizer state on one rank
      (whole parameters, largest first, to the least loaded rank).
    - ``zero2``: parameters, gradients and optimizer state sharded (FSDP2 pads dim 0 to a multiple of ``S``), but
      every layer's gathered compute-dtype parameters stay from forward to backward: ``gathered ~ N``. (In forward
      FSDP2 also keeps the all-gather buffer of the unit last gathered until the next one's is copied out, at most
      one unit more, before the activations are all saved: not counted.)
    - ``zero3``/``hsdp``: the root unit (embedding, final norm, output; kept gathered by ``apply_fsdp``), the layer
      in use and one more layer's all-gather buffer are gathered (in forward FSDP2 frees a unit's buffer only once
      the next is copied out; in backward it prefetches the next unit); ``hsdp`` shards over ``S`` instead of ``W``.
    - The sharded strategies also hold unsharded gradients: the root's through backward, one layer's before its
      reduce-scatter (plus its fp32 copy in the mixed modes). They reduce-scatter on every micro-step, also
      with ``gradient_accumulation_steps > 1``, so the sharded gradients accumulate in place and accumulation adds
      no memory.
    - ``cpu_offload``: sharded parameters, gradients and optimizer state move to ``host``.
    - ``activation_offloading``: the layers' activations move to ``host`` (see :func:`activation_bytes`).
    - ``tensor_parallel`` ``t`` > 1: every count above starts from this rank's TP shard of each parameter instead
      of the whole one (:func:`~toolkit.parallel.tp_shapes.tensor_parallel_local_parameters`, the placements of
      ``apply_tp``: projections split by rows or columns, embedding and output by vocabulary, norms and rotary
      buffers whole), which the strategy then shards over the ``world_size`` data-parallel ranks; activations and
      logits are one rank's (see :func:`activation_bytes` and :func:`logits_bytes`). ``ddp`` under TP runs as
      FSDP2 with a shard group of one (``parallel.apply_data_parallel``): it is counted as ``zero2`` sharded over
      one rank, every layer's compute-dtype copy kept from forward to backward. With one data-parallel rank
      nothing wraps the TP model, and mixed precision runs under autocast, as for ``ddp`` without TP.
    - ``expert_parallel`` ``e`` > 1 (``zero2`` or ``zero3``, without TP or ``cpu_offload``): each rank holds
      ``E/e`` of every mixture-of-experts layer's ``E`` experts
      (:func:`~toolkit.parallel.expert_parallel.expert_parallel_local_parameters`, the split of ``apply_ep``),
      which FSDP2 shards over the ``W/e`` ranks holding the same ones (padding dim 0 to a multiple of ``W/e``);
      the rest of the model is sharded over ``W`` as without EP. So the experts' stored parameters, gradients and
      optimizer state per rank are those without EP, up to that padding. ``apply_fsdp`` makes each layer's experts
      a unit of their own: under ``zero3`` the gathered layers are a layer's rest and its ``E/e`` experts in use,
      and the larger of the two as the next unit's all-gather buffer (experts held whole, ``W/e = 1``, have none):
      ``rest + experts + max(rest, experts)`` where without EP it is two whole layers of ``E`` experts; under
      ``zero2`` every unit, with ``E/e`` experts each. The unsharded gradients are a layer's, its rest's and its
      ``E/e`` experts'. The token exchange keeps more activations (see :func:`activation_bytes`) and holds
      ``all_to_all`` bytes while a layer's experts run (:func:`~toolkit.training.activation_memory.all_to_all_bytes`).

    Args:
        model: a :class:`~toolkit.modules.TransformerDecoder`, usually on the meta device.
        strategy: ``ddp``, ``zero1``, ``zero2``, ``zero3`` or ``hsdp``.
        world_size: data-parallel ranks (all nodes).
        num_nodes: nodes; HSDP shards within one by default.
        micro_batch_size: sequences per device per forward/backward.
        max_seq_len: tokens per sequence (padded batches use the longest; plan with the maximum).
        dtype: ``fp32``, ``bf16``, ``bf16-mixed`` or ``fp16-mixed``.
        activation_checkpointing: recompute each layer's activations in backward (true), or every k-th
            layer's (an integer k).
        activation_offloading: keep the layers' activations in host memory from forward to backward.
        cpu_offload: keep sharded state in host memory (sharded strategies only).
        trainable_params: parameters with gradients and optimizer state (LoRA); default: those with
            ``requires_grad``. When given, it is spread over shards and layers in proportion to their size.
        optimizer: ``adamw``, ``adam`` (2 states), ``adamw8bit``, ``adam8bit`` (2 states of 1 byte), ``sgd``
            (1: momentum) or ``muon`` (1 for the hidden matrices, 2 for the rest, which AdamW steps, and the step's
            transient buffers of whole matrices: :func:`~toolkit.training.muon.step_buffer_bytes`).
        optimizer_in_backward: each parameter steps as soon as its gradient is ready, which is then freed.
        tensor_parallel: ranks each layer is split over (config ``tensor_parallel``); ``world_size`` is then the
            data-parallel ranks, all processes over it.
        expert_parallel: data-parallel ranks each mixture-of-experts layer's experts are shared out over (config
            ``expert_parallel``; a divisor of ``world_size`` and of the experts, under ``zero2`` or ``zero3``).
        shard_size: HSDP's shard group size (default ``world_size // num_nodes``).
        gradient_accumulation_steps: micro-steps per optimizer step.
        kernels: how the step runs its attention and loss (see :class:`StepKernels`); by default SDPA and the
            projection fused with the loss, in one chunk.

    Raises:
        UserError: an unknown strategy, dtype or optimizer, ``cpu_offload`` without sharding, a world size the
            nodes or HSDP groups do not divide, or an ``expert_parallel`` the job, the strategy or the model refuses
            (:func:`~toolkit.parallel.mesh.expert_parallel_problems`,
            :func:`~toolkit.parallel.expert_parallel.check_expert_parallel`).
    """
    precision = _precision(dtype)
    if optimizer not in OPTIMIZER_STATES:
        raise UserError(f"optimizer: no memory model for {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATES)}")
    if micro_batch_size < 1 or max_seq_len < 1:
        raise UserError(f"micro_batch_size ({micro_batch_size}) and max_seq_len ({max_seq_len}) must be positive")
    shards = _check_shape(strategy, world_size, num_nodes, shard_size, cpu_offload)
    for problem in tensor_parallel_problems(
        tensor_parallel=tensor_parallel, world_size=None, strategy=strategy, cpu_offload=cpu_offload
    ) + expert_parallel_problems(
        expert_parallel=expert_parallel, world_size=world_size, strategy=strategy, tensor_parallel=tensor_parallel,
        cpu_offload=cpu_offload,
    ):
        raise UserError(": ".join(problem))
    p, c = precision.stored, precision.compute
    # FSDP2 reduces the gradients for the sharded strategies, and for ddp over tensor-parallel groups (ParallelDims.
    # uses_fsdp); otherwise mixed precision runs under autocast.
    # One data-parallel rank has nothing to shard over (apply_data_parallel leaves the model as it is).
    fsdp = world_size > 1 and (strategy in _SHARDED or tensor_parallel > 1)
    autocast = precision.autocast_when_replicated and not fsdp

    # This rank's tensor-parallel shard of each parameter, and its experts under expert parallelism (the parameters
    # themselves without either): everything below counts those, as FSDP2 shards them further.
    split_experts = expert_parallel_local_parameters(model, ep=expert_parallel)
    local = {**tensor_parallel_local_parameters(model, tp=tensor_parallel), **split_experts}
    experts = {id(t) for t in split_experts.values()}

    def shards_of(t: torch.Tensor) -> int:
        # FSDP2 shards a rank's experts over the ranks that hold the same ones (expert_fsdp_mesh).
        return shards // expert_parallel if id(t) in experts else shards

    params = [local[id(t)] for t in model.parameters()]
    total = sum(t.numel() for t in params)
    flagged = sum(t.numel() for t in params if t.requires_grad)
    trainable = flagged if trainable_params is None else trainable_params
    by_flags = trainable_params is None
    fraction = trainable / max(total, 1)

    def trainable_in(tensors: list[torch.Tensor]) -> float:
        if by_flags:
            return sum(t.numel() for t in tensors if t.requires_grad)
        return fraction * sum(t.numel() for t in tensors)

    def trainable_shard(tensors: list[torch.Tensor]) -> int:
        # Trainable elements of the given tensors on the rank holding the most (FSDP2's padded dim-0 shards).
        if not by_flags:  # (a rank's E/ep experts over shards/ep ranks: the same share as the rest's)
            return math.ceil(fraction * sum(t.numel() * (shards // shards_of(t)) for t in tensors) / shards)
        return sum(_stored_bytes(t, 1, shards_of(t)) for t in tensors if t.requires_grad)

    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())  # replicated by every strategy
    states = OPTIMIZER_STATES[optimizer]
    layers = [[local[id(t)] for t in layer.parameters()] for layer in model.layers]
    layer_ids = {id(t) for layer in layers for t in layer}
    root = [t for t in params if id(t) not in layer_ids]
    largest_layer = max(layers, key=lambda ts: sum(t.numel() for t in ts), default=[])

    def compute_copies(tensors: list[torch.Tensor]) -> int:
        # Unsharded in the compute dtype (FSDP2's gathered parameters); subclasses gather in their own format.
        return sum(_stored_bytes(t, c) for t in tensors)

    if not fsdp:
        param_bytes = sum(_stored_bytes(t, p) for t in params)
        grad_elems = trainable
        if strategy == "ddp" or world_size == 1:
            opt_elems = trainable
        elif by_flags:
            opt_elems = _largest_greedy_partition([t.numel() for t in params if t.requires_grad], world_size)
        else:
            opt_elems = math.ceil(trainable / world_size)
        # Autocast's compute copies of matmul weights, saved for backward; not of the embedding lookup or the norms
        # (which run as stored), nor of NF4 weights (dequantized inside the matmul, in forward and again in backward).
        embedding = local[id(model.embed_tokens.weight)]
        matmul_weights = [t for t in params if t.dim() >= 2 and t is not embedding]
        if model.output is None:
            matmul_weights.append(embedding)
        gathered = sum(c * t.numel() for t in matmul_weights if not _is_subclass(t)) if autocast else 0
    else:
        param_bytes = sum(_stored_bytes(t, p, shards_of(t)) for t in params)
        grad_elems = opt_elems = trainable_shard(params)
        if strategy in ("zero2", "ddp"):  # ddp: under TP, FSDP2 over a shard group of one (no resharding)
            gathered_params = compute_copies(params)  # every unit stays unsharded from its forward to its backward
        else:
            # A layer's units (its experts are one of their own under EP) in use, and the larger unit's all-gather
            # buffer beside them; experts that one rank holds whole are copied, not all-gathered: no buffer.
            rest = max((compute_copies([t for t in ts if id(t) not in experts]) for ts in layers), default=0)
            unit = max((compute_copies([t for t in ts if id(t) in experts]) for ts in layers), default=0)
            buffer = max(rest, unit if shards > expert_parallel else 0)
            gathered_params = compute_copies(root) + rest + unit + buffer
        # Unsharded gradients: the root's live through backward (it reduce-scatters last), one layer's until its
        # reduce-scatter, which in the mixed modes first casts them to fp32.
        unsharded_grads = c * trainable_in(root) + (c + (p if p != c else 0)) * trainable_in(largest_layer)
        # With gradient accumulation the sharded strategies still reduce-scatter every micro-step (see
        # parallel.gradient_sync), so accumulation adds nothing here.
        gathered = int(gathered_params + unsharded_grads)
    if optimizer_in_backward:
        # Each gradient is freed as soon as its parameter has stepped: one exists at a time, at most the largest.
        if by_flags:
            grad_elems = max((_stored_bytes(t, 1, shards_of(t)) for t in params if t.requires_grad), default=0)
        else:
            grad_elems = math.ceil(fraction * max(t.numel() * (shards // shards_of(t)) for t in params) / shards)
    reference = reference_host = 0
    frozen = [model] * kernels.reference_model + ([kernels.frozen_model] if kernels.frozen_model is not None else [])
    for frozen_model in frozen:
        device_bytes, host_bytes = _frozen_copy_bytes(
            frozen_model, compute=c, sharded=strategy in _SHARDED and world_size > 1, shards=shards,
            cpu_offload=cpu_offload, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
        )
        reference, reference_host = reference + device_bytes, reference_host + host_bytes
    rows = micro_batch_size * kernels.sequences_per_sample  # sequences per forward
    activations = dict(
        micro_batch_size=rows, seq_len=max_seq_len, dtype=dtype,
        activation_checkpointing=activation_checkpointing, autocast=autocast, flex_attention=kernels.flex_attention,
        tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
    )
    host = offloaded_activation_bytes(model, **activations) if activation_offloading else 0
    step_bytes = 0
    if optimizer == "muon":  # one buffer per Muon matrix, AdamW's two for the rest, in proportion to their elements
        named = [(name, local[id(t)]) for name, t in model.named_parameters()]
        trained = [(name, t) for name, t in named if t.requires_grad or not by_flags]
        muon = [t.numel() for name, t in trained if muon_by_default(name, t, adapters=False)]
        states = (2 * sum(t.numel() for _, t in trained) - sum(muon)) / max(1, sum(t.numel() for _, t in trained))
        # The ranks that exchange whole matrices: a shard group (hsdp: not the replicas), every rank under ddp;
        # under zero1 each rank orthogonalizes its own whole matrices and exchanges none.
        exchange = shards if fsdp else world_size if strategy == "ddp" else 1
        step_bytes = step_buffer_bytes(muon, world=exchange, sharded=fsdp, update_itemsize=p)
    grad_bytes = p * grad_elems
    opt_bytes = int(_STATE_ELEMENT_BYTES.get(optimizer, p) * states * opt_elems) + step_bytes
    host += reference_host
    # NF4 weights are quantized whole as they load, on every rank, and split afterwards (parallelize): on the device,
    # or in host memory under cpu_offload (FSDP2 then moves one layer at a time to the device to split it).
    whole_nf4 = sum(_stored_bytes(t, p) for t in model.parameters()) + buffer_bytes if has_nf4(model) else 0
    if cpu_offload:
        host = max(host + param_bytes + grad_bytes + opt_bytes, whole_nf4)
        param_bytes = grad_bytes = opt_bytes = 0

    return MemoryEstimate(
        strategy=strategy,
        cpu_offload=cpu_offload,
        dtype=dtype,
        world_size=world_size,
        shard_size=shards,
        params=param_bytes + buffer_bytes,
        grads=grad_bytes,
        optimizer_state=opt_bytes,
        activations=activation_bytes(model, activation_offloading=activation_offloading, **activations),
        logits=logits_bytes(
            model, micro_batch_size=rows, seq_len=max_seq_len, dtype=dtype,
            loss_chunks=kernels.loss_chunks, fused=kernels.fused_loss, tensor_parallel=tensor_parallel,
        ),
        gathered=gathered,
        host=host,
        tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
        all_to_all=all_to_all_bytes(
            model, micro_batch_size=rows, seq_len=max_seq_len, dtype=dtype, expert_parallel=expert_parallel
        ),
        reference=reference,
        loading=0 if cpu_offload else whole_nf4,
    )


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
    strategies are candidates (see :mod:`toolkit.training.optim`); with ``cpu_offload=False`` (training on the
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
        if optimizer_in_backward and world_size > 1 and strategy not in _SHARDED and tensor_parallel == 1:
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
        if optimizer_in_backward and dp > 1 and tp == 1 and layout_strategy not in _SHARDED:
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
        for title, attribute in _ROWS[:-1]
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
        for title, attribute in _ROWS[:-1]
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
        strategy: the ``data_parallel`` strategy.
        cpu_offload: whether sharded parameters and optimizer state live in host memory.
        micro_batch_size: sequences per device per forward/backward.
        accumulation_steps: micro-steps per optimizer step (``batch_size = data-parallel ranks x micro x steps``).
        reasons: one line per ``auto`` decision or cut micro batch, naming the numbers it was made from.
        tensor_parallel: ranks each layer is split over.
    """

    strategy: str
    cpu_offload: bool
    micro_batch_size: int
    accumulation_steps: int
    reasons: tuple[str, ...] = ()
    tensor_parallel: int = 1


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

    Raises:
        UserError: ``auto`` without a known device memory, nothing fits, sizes that do not divide, or an invalid
            ``activation_checkpointing``.
    """
    checkpoint_interval(activation_checkpointing)  # refused here, before any weight is loaded
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
        return ParallelPlan(strategy, cpu_offload, micro_batch_size, steps, tuple(reasons), tp)
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
    return ParallelPlan(strategy, cpu_offload, micro, steps, tuple(reasons), tp)


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
