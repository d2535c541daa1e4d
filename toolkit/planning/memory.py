"""How much device memory a training step needs under each data-parallel strategy (``tune plan`` and the ``auto``
choices of :mod:`toolkit.planning.layout`).

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
  :func:`~toolkit.planning.activation_memory.activation_bytes`.
- **logits**: the peak of the logits and the loss's float32 copies, see
  :func:`~toolkit.planning.activation_memory.logits_bytes`.
- **gathered**: full-size parameters and gradients that exist only around compute: FSDP2's unsharded layers and
  their unsharded gradients, or autocast's low-precision copies of the weights (DDP and ZeRO-1 mixed modes).
- **all-to-all**: under expert parallelism, the buffers of tokens the experts' exchange holds while a layer's
  experts run, see :func:`~toolkit.planning.activation_memory.all_to_all_bytes`.

The total is the sum. That is the peak at the start of a backward pass with gradient accumulation, when the
previous micro-steps' gradients, the optimizer state, every saved activation and the loss's buffers coexist; with
one micro-step it overestimates by at most the gradients, and under expert parallelism by at most the all-to-all
buffers (they exist while a layer's experts run, not while the loss does). It counts tensors, not the CUDA caching
allocator's rounding and fragmentation, the CUDA context or NCCL's buffers: the choices of
:mod:`toolkit.planning.layout` keep ``1 - headroom`` of the device free for those.

The per-token formulas of the activations and logits, which depend on how the step computes (:class:`StepKernels`)
but not on the strategy, live in :mod:`toolkit.planning.activation_memory`; this module adds each strategy's
parameters, gradients, optimizer state and gathered copies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.modules.peft.nf4_experts import has_nf4
from toolkit.parallel.expert_parallel import expert_parallel_local_parameters
from toolkit.parallel.mesh import (
    ONE_PROCESS_OFFLOAD,
    SHARDED_STRATEGIES,
    STRATEGIES,
    expert_parallel_problems,
    tensor_parallel_problems,
)
from toolkit.parallel.tp_shapes import tensor_parallel_local_parameters
# The activation and logits formulas, also importable from here as they were before they got their own module.
from toolkit.planning.activation_memory import (
    _precision,
    activation_bytes,
    all_to_all_bytes,
    logits_bytes,
    offloaded_activation_bytes,
)
from toolkit.optim.muon import muon_by_default, step_buffer_bytes


# Optimizer state tensors per trainable parameter, each in the stored parameter dtype (but see below).
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "adamw8bit": 2, "adam8bit": 2, "muon": 1}
# (Muon: one momentum buffer for its hidden matrices; the AdamW it runs on everything else keeps two. The estimate
# counts each parameter with its own, and the step's transient buffers, see toolkit.optim.muon.step_buffer_bytes.)
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
            :func:`~toolkit.planning.activation_memory.activation_bytes`).
        loss_chunks: the output projection and loss run over this many sequence chunks (config ``loss_chunks``;
            ``None``: whole, see :func:`~toolkit.planning.activation_memory.logits_bytes`).
        fused_loss: the projection and loss are fused, so that no chunk's logits outlive it (config ``fused_loss``,
            on by default in the recipes and ``forward_backward``; see
            :func:`~toolkit.planning.activation_memory.logits_bytes`).
        sequences_per_sample: rows one sample of the batch becomes (the preference recipe's pairs: 2, chosen and
            rejected in one forward), so activations and logits count ``micro_batch_size`` times this many rows.
        reference_model: a frozen copy of the model scores each batch beside it (full-fine-tuning preference
            tuning with a live reference), laid out as the policy (see :attr:`MemoryEstimate.reference`).
        frozen_model: another frozen model (of its own shape, on the meta device) scores each batch beside it,
            laid out alike: distillation's teacher.
        rollout_samples: completions sampled together for each sample of a micro-batch before the step (online RL:
            each prompt's ``num_generations``), whose KV cache spans ``max_seq_len`` positions (see
            :attr:`MemoryEstimate.rollout`); 0: no sampling.
    """

    flex_attention: bool = False
    loss_chunks: int | None = None
    fused_loss: bool = True
    sequences_per_sample: int = 1
    reference_model: bool = False
    frozen_model: nn.Module | None = None
    rollout_samples: int = 0


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
    kv_cache: int = 0
    rollout_gathered: int = 0

    @property
    def rollout(self) -> int:
        """Per-device bytes while completions are sampled (online RL), between steps: the stored parameters,
        optimizer state and frozen model, the whole model gathered (FSDP2 keeps every unit unsharded for the rollout),
        the KV cache, and the last position's float32 logits; no gradients or activations."""
        if not self.kv_cache:
            return 0
        return self.params + self.optimizer_state + self.reference + self.rollout_gathered + self.kv_cache

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
        return max(step, self.loading, self.rollout)

    def table(self) -> str:
        """The estimate as a one-column table (see :func:`format_table`)."""
        return format_table([self])

    def __str__(self) -> str:
        return self.table()


ROWS = (
    ("params", "params"),
    ("grads", "grads"),
    ("optimizer state", "optimizer_state"),
    ("activations", "activations"),
    ("logits + loss", "logits"),
    ("gathered", "gathered"),
    ("all-to-all", "all_to_all"),
    ("frozen model", "reference"),  # the preference recipe's reference copy, distillation's teacher
    ("loading (whole)", "loading"),  # an NF4 model before it is split
    ("rollout", "rollout"),  # online RL's sampling: the KV cache and the whole model gathered, between steps
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
             "reference": any(e.reference for e in estimates), "loading": any(e.loading for e in estimates),
             "rollout": any(e.rollout for e in estimates)}
    for title, attribute in ROWS:
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
    if cpu_offload and strategy not in SHARDED_STRATEGIES:
        raise UserError(f"cpu_offload: needs a sharded strategy ({', '.join(SHARDED_STRATEGIES)}), not data_parallel={strategy}")
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
    layers = [[local[id(t)] for t in layer.parameters()] for layer in model.decoder_layers().values()]
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
      ``all_to_all`` bytes while a layer's experts run (:func:`~toolkit.planning.activation_memory.all_to_all_bytes`).

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
            transient buffers of whole matrices: :func:`~toolkit.optim.muon.step_buffer_bytes`).
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
    fsdp = world_size > 1 and (strategy in SHARDED_STRATEGIES or tensor_parallel > 1)
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
    layers = [[local[id(t)] for t in layer.parameters()] for layer in model.decoder_layers().values()]
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
        embedding = local[id(model.token_embedding().weight)]
        matmul_weights = [t for t in params if t.dim() >= 2 and t is not embedding]
        if model.output_projection() is None:
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
            frozen_model, compute=c, sharded=strategy in SHARDED_STRATEGIES and world_size > 1, shards=shards,
            cpu_offload=cpu_offload, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
        )
        reference, reference_host = reference + device_bytes, reference_host + host_bytes
    rows = micro_batch_size * kernels.sequences_per_sample  # sequences per forward
    rollout_rows = micro_batch_size * kernels.rollout_samples  # sequences sampled together (online RL)
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
        kv_cache=kv_cache_bytes(model, rows=rollout_rows, seq_len=max_seq_len, element_bytes=c,
                                tensor_parallel=tensor_parallel),
        # The rollout gathers every unit at once: the whole model in the compute dtype (FSDP2 all-gathers into buffers
        # of its own, beside the stored shards); and the float32 logits of the last position of every row.
        rollout_gathered=(compute_copies(params) if fsdp and rollout_rows else 0)
        + rollout_rows * model.token_embedding().weight.shape[0] * 4,
    )


def kv_cache_bytes(model: nn.Module, *, rows: int, seq_len: int, element_bytes: int, tensor_parallel: int = 1) -> int:
    """Bytes of the keys and values ``rows`` sequences of ``seq_len`` positions cache in every attention layer (in the
    compute dtype, ``element_bytes`` an element; under tensor parallelism each rank caches its share of the heads)."""
    if not rows:
        return 0
    per_position = 0
    for layer in model.decoder_layers().values():
        keys = getattr(getattr(getattr(layer, "self_attn", None), "k_proj", None), "weight", None)
        if keys is not None:  # keys and values: kv_heads x head_dim each
            per_position += 2 * keys.shape[0] // tensor_parallel
    return rows * seq_len * per_position * element_bytes
