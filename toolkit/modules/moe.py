"""Mixture-of-experts feed-forward: a top-k router and grouped, dropless experts (Shazeer et al., 2017,
https://arxiv.org/abs/1701.06538; Mixtral, https://arxiv.org/abs/2401.04088; Qwen3, https://arxiv.org/abs/2505.09388).

The experts' weights are stacked, ``[num_experts, out, in]`` per projection, so that all the tokens routed to every
expert go through one grouped matrix multiply per projection (``torch._grouped_mm`` where the device has it, an
exact per-expert fallback elsewhere): no Python loop over tokens, and no token dropped for capacity.

The load-balancing loss (Switch Transformer, https://arxiv.org/abs/2101.03961, eq. 4-6, as ``transformers``
computes it for Mixtral and Qwen3-MoE, pooled over the MoE layers) is taken per row of the batch, over its real
(unpadded) tokens: for a batch of one row it is ``transformers``' value, and since no row's statistics depend on
the others, the total over a global batch is the same whatever its split into ranks and micro-batches.

Routing replay (:func:`record_routing`, :func:`replay_routing`) makes later forwards of the same tokens use the
experts an earlier forward chose: online RL computes its old log-probabilities in one forward and trains in
others, and a mixture-of-experts policy whose router picks other experts in between drifts off (see
:func:`replay_routing`).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor


class TopKRouter(nn.Module):
    """Scores every expert for each token and keeps the ``top_k`` best.

    The weight is a bias-free linear layer's, ``[num_experts, dim]`` (``transformers``' ``mlp.gate.weight``). The
    scores are a float32 softmax over all experts; the kept weights are the top ``top_k`` of them, renormalized to
    sum to one when ``norm_topk_prob`` (Mixtral always: its softmax over the top-k logits is the same thing).

    Args:
        dim: model width.
        num_experts: experts to choose from.
        top_k: experts per token.
        norm_topk_prob: renormalize the kept weights.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's; a checkpoint or init_weights overwrites it

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores ``[t, num_experts]`` (float32 softmax), and each token's kept weights and experts ``[t, top_k]``
        (the weights in ``x``'s dtype) for tokens ``x`` ``[t, dim]``.

        Given ``experts`` (routing replay), those are kept instead of the top ``top_k``: the weights are the
        current scores at them, renormalized the same way, so the router still gets its gradient. Either way the
        weights are gathered at the chosen experts (the values and gradient ``topk``'s would give), so that a
        forward of either kind saves the same tensors for backward: activation checkpointing requires it of a
        recomputation."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        if experts is None:
            experts = torch.topk(probs.detach(), self.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` ``[n, in]`` (rows sorted by group, ``counts[e]`` rows for group ``e``) times each group's
    ``weight[e]`` ``[out, in]`` transposed: ``[n, out]``.

    ``torch._grouped_mm`` where this device and dtype have it (one kernel for all groups); otherwise one matrix
    multiply per group's contiguous rows, which gives the same values.
    """
    weight_t = weight.transpose(-2, -1)  # [E, in, out]
    if _has_grouped_mm(x.device.type, x.dtype) and _aligned(x, weight_t, weight.shape[-2]):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return torch._grouped_mm(x, weight_t, offs=offsets)
    segments = x.split(counts.tolist())
    return torch.cat([segment @ weight[e].T for e, segment in enumerate(segments)])


def _aligned(x: torch.Tensor, weight_t: torch.Tensor, out_dim: int) -> bool:
    # The kernel needs every stride but the unit one, and the output's rows, to be multiples of 16 bytes (a LoRA
    # adapter's rank of 3 in float32 is not).
    step = 16 // x.element_size()
    strides = [s for t in (x, weight_t) for s in t.stride() if s != 1]
    return out_dim % step == 0 and all(s % step == 0 for s in strides)


@cache
def _has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    # Asked once per device type and dtype with a tiny call: which ones have a kernel depends on the torch version
    # (CPU since 2.10; CUDA bfloat16 on compute capability 9.0 and newer), and an unsupported call raises.
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.zeros(16, 16, device=device_type, dtype=dtype)
        w = torch.zeros(2, 16, 16, device=device_type, dtype=dtype)
        torch._grouped_mm(x, w, offs=torch.tensor([8, 16], dtype=torch.int32, device=device_type))
    except (RuntimeError, NotImplementedError):
        return False
    return True


PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The stacked parameters of :class:`GroupedExperts`, in order."""


class GroupedExperts(nn.Module):
    """``num_experts`` gated feed-forwards (SwiGLU by default) with stacked weights, run as grouped matmuls.

    The parameters are ``gate_proj`` and ``up_proj`` ``[num_experts, hidden_dim, dim]`` and ``down_proj``
    ``[num_experts, dim, hidden_dim]``: expert ``e``'s slices are a plain ``nn.Linear``'s weights, as
    ``transformers`` checkpoints store them one expert at a time.

    Args:
        num_experts: experts.
        dim: model width.
        hidden_dim: each expert's feed-forward width.
        activation: of the gate; SiLU by default.
    """

    def __init__(self, *, num_experts: int, dim: int, hidden_dim: int, activation: nn.Module | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.activation = activation if activation is not None else nn.SiLU()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's slices as ``nn.Linear`` initializes its weight (a checkpoint normally overwrites them)."""
        for param in (self.gate_proj, self.up_proj, self.down_proj):
            bound = 1 / param.shape[-1] ** 0.5
            nn.init.uniform_(param, -bound, bound)

    def project(self, name: str, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Projection ``name`` (``gate_proj``, ``up_proj`` or ``down_proj``) of rows ``x`` grouped by expert
        (``counts`` rows each); adapters override it."""
        weight = getattr(self, name)
        if isinstance(weight, nn.Module):  # stored quantized (QLoRA's toolkit.modules.peft.NF4Stack): it multiplies
            return weight(x, counts)
        return grouped_mm(x, local(weight), counts)

    def base_weight(self, name: str) -> torch.Tensor:
        """Projection ``name``'s stacked weight ``[num_experts, out, in]`` in full precision (dequantized when stored
        in NF4)."""
        weight = getattr(self, name)
        return weight.dequantize() if isinstance(weight, nn.Module) else weight

    def compute(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Every expert's SwiGLU on its rows of ``routed`` (grouped by expert, ``counts[e]`` rows for expert ``e``):
        ``[rows, dim]``. Expert parallelism (``toolkit.parallel.apply_ep``) wraps it in its token exchange."""
        hidden = self.activation(self.project("gate_proj", routed, counts)) * self.project("up_proj", routed, counts)
        return self.project("down_proj", hidden, counts)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for tokens ``x`` ``[t, dim]``, each routed to ``experts`` ``[t, k]`` and mixed by
        ``weights`` ``[t, k]``: ``[t, dim]``.

        The ``t * k`` assignments are sorted by expert (stably, so the order is the same on every run) and computed
        in one grouped matmul per projection. Tokens are copied to their assignments and summed back over ``k``
        without any scatter-add: the result is bitwise reproducible on every device.
        """
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)  # assignment i belongs to token i // k
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        routed = permute_rows(x.repeat_interleave(top_k, dim=0), order)  # [t * k, dim], grouped by expert
        out = self.compute(routed, counts)
        unsorted = torch.empty_like(out).index_copy_(0, order, out)  # back to token-major order
        return (unsorted.view(num_tokens, top_k, -1) * weights.unsqueeze(-1)).sum(dim=1)


class _Permute(torch.autograd.Function):
    """``x[order]`` for a permutation ``order`` of the rows, whose backward is the inverse permutation, a gather too:
    indexing's own backward is a scatter-add (``index_put_`` accumulating), several times slower on CPU, and
    atomic, so not bitwise reproducible, on GPUs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(order)
        return x[order]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (order,) = ctx.saved_tensors
        return torch.empty_like(grad).index_copy_(0, order, grad), None


def permute_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x[order]`` for ``order`` a permutation of ``x``'s rows, with a gather for backward (see :class:`_Permute`)."""
    return _Permute.apply(x, order)


def local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a stacked weight split over expert-parallel ranks (a DTensor), or ``weight``."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


@dataclass
class Routing:
    """What one MoE layer's router decided for a batch: the scores ``[b, s, num_experts]`` (float32, part of the
    autograd graph) and the chosen experts ``[b, s, top_k]`` (the replayed ones under :func:`replay_routing`)."""

    probs: torch.Tensor
    experts: torch.Tensor


class MoEFeedForward(nn.Module):
    """A mixture-of-experts feed-forward block: ``experts(x, *gate(x))``, plus ``shared_expert(x)`` where there is one.

    After each forward, :attr:`routing` holds the router's decisions for the batch, which the decoder turns into the
    load-balancing loss and the per-expert token counts (:func:`routing_statistics`).

    Args:
        gate: the router.
        experts: the routed experts.
        shared_expert: a feed-forward every token also goes through (room for the families that have one).
    """

    def __init__(self, *, gate: TopKRouter, experts: GroupedExperts, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        if gate.num_experts != experts.num_experts:
            raise ValueError(f"the router scores {gate.num_experts} experts but there are {experts.num_experts}")
        self.gate = gate
        self.experts = experts
        self.shared_expert = shared_expert
        self.routing: Routing | None = None
        # Set only inside record_routing / replay_routing: a plain attribute, not a buffer, so no state_dict sees it.
        self._routing_session: _RoutingSession | None = None

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        if _pinning.count:  # a routing record or replay, or a recomputation of a forward under one
            probs, weights, experts = self._pinned_route(tokens)
        else:
            probs, weights, experts = self.gate(tokens)
        self.routing = Routing(probs.view(b, s, -1), experts.view(b, s, -1))
        out = self.experts(tokens, experts, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(b, s, dim)

    def _pinned_route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # The router's decision where something fixes the experts: a checkpointed layer's recomputation in backward
        # takes those of its first forward (whatever session is open now); otherwise this layer's session, if any,
        # replays its record's next forward or records this one.
        recomputing, experts, capturing = _checkpointed_choice(self)
        session = None if recomputing else self._routing_session
        pinned = session is not None or experts is not None
        if session is not None:
            if torch._C._current_graph_task_id() != -1:
                raise RuntimeError(
                    f"routing replay: {session.path} ran a forward during backward that is not a recomputation of "
                    "toolkit's activation checkpointing; checkpoint with "
                    "context_fn=toolkit.modules.moe.routing_checkpoint_context (toolkit.training.activations does)"
                )
            experts = session.replayed(tokens, self.top_k)
        probs, weights, experts = self.gate(tokens, experts)
        if session is not None:
            session.note(experts, probs)
        if pinned:  # an enclosing checkpoint's recomputation takes the same
            for frame in capturing:
                frame.chosen.setdefault(self, []).append(experts)
        return probs, weights, experts


# --- Routing replay ------------------------------------------------------------------------------------------------


class RoutingRecord:
    """The experts each mixture-of-experts layer chose, forward by forward, by the layer's module path
    (``layers.0.mlp``): what :func:`record_routing` collects and :func:`replay_routing` reuses.

    ``record[i:j]`` is the record of forwards ``i`` to ``j - 1`` of every layer; ``len(record)`` the number of
    forwards recorded (the most of any layer).
    """

    def __init__(self, forwards: dict[str, list[torch.Tensor]] | None = None) -> None:
        self._forwards: dict[str, list[torch.Tensor]] = forwards if forwards is not None else {}

    def paths(self) -> list[str]:
        """The layers recorded, in the model's order."""
        return list(self._forwards)

    def forwards(self, path: str) -> list[torch.Tensor]:
        """Layer ``path``'s chosen experts, ``[tokens, top_k]`` int64 (detached) per forward, in call order.

        Raises:
            ValueError: no layer ``path`` in the record.
        """
        if path not in self._forwards:
            raise ValueError(f"the routing record has no layer {path!r}; it has {', '.join(self._forwards) or 'none'}")
        return list(self._forwards[path])

    def __len__(self) -> int:
        return max((len(forwards) for forwards in self._forwards.values()), default=0)

    def __getitem__(self, forwards: slice) -> "RoutingRecord":
        if not isinstance(forwards, slice):
            raise TypeError(f"a routing record is sliced by forwards (record[i:j]), not indexed by {forwards!r}")
        return RoutingRecord({path: chosen[forwards] for path, chosen in self._forwards.items()})


@dataclass
class _RoutingSession:
    """One layer's part in a :func:`record_routing` (``record``) or :func:`replay_routing` (``replay``: the
    forwards to take, from ``start``; ``fresh``: what the router would have chosen instead)."""

    path: str
    record: list[torch.Tensor] | None = None
    replay: list[torch.Tensor] | None = None
    start: int = 0
    fresh: list[torch.Tensor] = field(default_factory=list)
    calls: int = 0  # forwards run in the session; a checkpointed layer's recomputation is not one

    def replayed(self, tokens: torch.Tensor, top_k: int) -> torch.Tensor | None:
        """The experts this forward of ``tokens`` ``[t, dim]`` takes (None when recording: the router's top-k)."""
        if self.replay is None:
            return None
        index = self.start + self.calls
        if index >= len(self.replay):
            raise ValueError(
                f"routing replay: {self.path} has {len(self.replay)} recorded forwards and this is forward "
                f"{index + 1}; replay as many forwards as were recorded"
            )
        experts = self.replay[index]
        if experts.shape != (tokens.shape[0], top_k):
            raise ValueError(
                f"routing replay: {self.path} recorded experts {list(experts.shape)} ([tokens, top_k]) in forward "
                f"{index} and this forward has {tokens.shape[0]} tokens and top_k {top_k}; replay the same tokens"
            )
        experts = experts.to(tokens.device)
        # Recorded under torch.inference_mode (a rollout's old log-probabilities may be): autograd may not save an
        # inference tensor (the weights' gather saves its index), and outside that mode a clone is a plain one.
        return experts.clone() if experts.is_inference() else experts

    def note(self, experts: torch.Tensor, probs: torch.Tensor) -> None:
        """Keep this forward's choice (recording), or the router's own top-k beside the replayed one."""
        self.calls += 1
        if self.record is not None:
            self.record.append(experts.detach())
        else:
            self.fresh.append(torch.topk(probs.detach(), experts.shape[-1], dim=-1).indices)


class _Pinning:
    """How many things fix a router's choice now (open sessions, recomputations of checkpointed forwards that had
    one): while none does, :class:`MoEFeedForward` takes the plain top-k without looking further (a compiled layer
    sees an integer guard, not the frames); and the open checkpoint frames, innermost last.

    One per process, not per thread: a recomputation runs on autograd's device thread while the thread that called
    ``backward`` waits, and one thread at a time runs the model."""

    def __init__(self) -> None:
        self.count = 0
        self.frames: list[_CheckpointFrame] = []


_pinning = _Pinning()


class _CheckpointFrame:
    """A context manager around one checkpointed region's first forward (``recompute`` false: it collects each
    layer's experts in ``chosen``) or its recomputation in backward (``recompute``: each layer takes them back, in
    order). Both share ``chosen``; a recomputation may run more than once (a retained graph), each from the start."""

    def __init__(self, chosen: dict["MoEFeedForward", list[torch.Tensor]], *, recompute: bool) -> None:
        self.chosen = chosen
        self.recompute = recompute
        self.taken: dict[MoEFeedForward, int] = {}

    def __enter__(self) -> None:
        self.taken = {}
        _pinning.frames.append(self)
        if self.recompute and self.chosen:
            _pinning.count += 1

    def __exit__(self, *exc) -> None:
        _pinning.frames.remove(self)
        if self.recompute and self.chosen:
            _pinning.count -= 1

    def take(self, block: "MoEFeedForward") -> torch.Tensor | None:
        index = self.taken.get(block, 0)
        self.taken[block] = index + 1
        chosen = self.chosen.get(block, [])
        return chosen[index] if index < len(chosen) else None


def routing_checkpoint_context() -> tuple[_CheckpointFrame, _CheckpointFrame]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant) so that a checkpointed layer's
    recomputation in backward routes its tokens to the experts its first forward used under a routing record or
    replay, instead of advancing the replay or recording a second time."""
    chosen: dict[MoEFeedForward, list[torch.Tensor]] = {}
    return _CheckpointFrame(chosen, recompute=False), _CheckpointFrame(chosen, recompute=True)


def _checkpointed_choice(block: MoEFeedForward) -> tuple[bool, torch.Tensor | None, list[_CheckpointFrame]]:
    """Whether ``block`` runs inside a recomputation, the experts its first forward took there (None: the router
    chose freely), and the first-forward frames inside that recomputation (all open ones when not recomputing),
    which collect what this forward takes."""
    capturing = []
    for frame in reversed(_pinning.frames):
        if frame.recompute:
            return True, frame.take(block), capturing
        capturing.append(frame)
    return False, None, capturing


_WRAPPERS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def _moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """``model``'s mixture-of-experts layers by module path, the names of wrappers (compile's, FSDP1's, the
    checkpoint wrapper's, DDP's) left out so that a record made through one replays on the other."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    layers = {
        ".".join(part for part in name.split(".") if part not in _WRAPPERS): module
        for name, module in model.named_modules() if isinstance(module, MoEFeedForward)
    }
    if not layers:
        raise ValueError(f"routing replay: {type(model).__name__} has no mixture-of-experts layers (MoEFeedForward)")
    return layers


@contextlib.contextmanager
def _sessions(layers: dict[str, MoEFeedForward], sessions: dict[str, _RoutingSession]) -> Iterator[None]:
    busy = [path for path, layer in layers.items() if layer._routing_session is not None]
    if busy:
        raise ValueError(f"routing replay: {busy[0]} is already recording or replaying; close that context first")
    for path, layer in layers.items():
        layer._routing_session = sessions[path]
    _pinning.count += 1
    try:
        yield
    finally:
        _pinning.count -= 1
        for layer in layers.values():
            layer._routing_session = None


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[RoutingRecord]:
    """Record, for every mixture-of-experts layer of ``model``, the experts it chooses in each forward run inside
    the context: the :class:`RoutingRecord` yielded fills as they run.

    Nothing is added to the model's state (its ``state_dict`` is unchanged). A layer checkpointed with
    :func:`routing_checkpoint_context` records one entry per forward, not another for its recomputation.

    Raises:
        ValueError: ``model`` has no mixture-of-experts layer, or one is already recording or replaying.
    """
    layers = _moe_layers(model)
    record = RoutingRecord({path: [] for path in layers})
    with _sessions(layers, {path: _RoutingSession(path, record=record._forwards[path]) for path in layers}):
        yield record


@contextlib.contextmanager
def replay_routing(model: nn.Module, record: RoutingRecord, *, forward_index: int | None = None
                   ) -> Iterator[RoutingRecord]:
    """Route every forward run inside the context as ``record`` did: the ``i``-th forward of each layer takes the
    experts of the record's forward ``forward_index + i`` of that layer (``forward_index`` 0 when None: one
    recorded pass replayed as a whole; ``forward_index=m``: a pass over micro-batches in another order replays
    micro-batch ``m``'s entry).

    The router still scores every expert, and the kept weights are its current scores at the replayed experts,
    renormalized as ``norm_topk_prob`` says: the router gets the gradient it gets for a fresh choice. Under
    activation checkpointing with :func:`routing_checkpoint_context` (``toolkit.training.activations`` passes it),
    the recomputation in backward takes the same experts as its forward, even after the context has closed.
    Expert parallelism routes with the same router before its token exchange, so it replays alike, each rank its
    own tokens. A layer compiled with ``torch.compile`` is not supported.

    Yields:
        the experts the router would have chosen itself in each forward (its top-k), as a :class:`RoutingRecord`:
        ``routing_agreement(record[m:m + n], yielded)`` is the share it agrees with the replayed ones.

    Raises:
        ValueError: the record's layers are not the model's, ``forward_index`` is outside it, a layer is already
            recording or replaying; in a forward, a layer whose recorded tokens or ``top_k`` differ, or one with no
            recorded forward left (each naming the layer).
    """
    layers = _moe_layers(model)
    recorded = record.paths()
    if set(recorded) != set(layers):
        missing, extra = sorted(set(layers) - set(recorded)), sorted(set(recorded) - set(layers))
        raise ValueError(
            "routing replay: the record's mixture-of-experts layers are not the model's ("
            + "; ".join(part for part in (missing and f"not recorded: {', '.join(missing)}",
                                          extra and f"not in the model: {', '.join(extra)}") if part) + ")"
        )
    if not len(record):
        raise ValueError("routing replay: the record holds no forwards (record_routing saw none)")
    start = 0 if forward_index is None else forward_index
    if not 0 <= start < len(record):
        raise ValueError(f"routing replay: forward_index {forward_index} is outside the record's {len(record)} "
                         f"forwards (0 to {len(record) - 1})")
    sessions = {path: _RoutingSession(path, replay=record._forwards[path], start=start) for path in layers}
    with _sessions(layers, sessions):
        yield RoutingRecord({path: session.fresh for path, session in sessions.items()})


def routing_agreement(record_a: RoutingRecord, record_b: RoutingRecord) -> float:
    """The share of the ``(token, k)`` choices of ``record_a`` that ``record_b`` makes too: for every layer,
    forward and token, how many of its ``top_k`` experts in ``record_a`` are among those in ``record_b``, over all
    of them (the order of a token's experts does not matter). 1.0 when both chose alike everywhere.

    Raises:
        ValueError: the records differ in layers, forwards or shapes (naming the first such layer), or are empty.
    """
    if record_a.paths() != record_b.paths():
        raise ValueError(f"routing_agreement: the records have other layers ({record_a.paths()} and "
                         f"{record_b.paths()})")
    same = total = 0
    for path in record_a.paths():
        forwards_a, forwards_b = record_a.forwards(path), record_b.forwards(path)
        if len(forwards_a) != len(forwards_b):
            raise ValueError(f"routing_agreement: {path} has {len(forwards_a)} forwards in one record and "
                             f"{len(forwards_b)} in the other")
        for i, (a, b) in enumerate(zip(forwards_a, forwards_b)):
            if a.shape != b.shape:
                raise ValueError(f"routing_agreement: {path} forward {i} chose {list(a.shape)} and "
                                 f"{list(b.shape)} ([tokens, top_k])")
            same += int((a.unsqueeze(-1) == b.to(a.device).unsqueeze(-2)).any(dim=-1).sum())
            total += a.numel()
    if not total:
        raise ValueError("routing_agreement: the records hold no choices")
    return same / total


@dataclass
class RoutingStatistics:
    """The routing of a batch pooled over the MoE layers, per row.

    Attributes:
        aux_loss: the load-balancing loss of each row ``[b]`` (0 for a row without real tokens).
        tokens_per_expert: assignments to each expert by layer ``[layers, num_experts]``, over the batch's real
            tokens (detached, float32).
    """

    aux_loss: torch.Tensor
    tokens_per_expert: torch.Tensor


def routing_statistics(routings: list[Routing], *, num_experts: int, lengths: torch.Tensor | None) -> RoutingStatistics:
    """The load-balancing loss of each row and the per-expert token counts, from each MoE layer's :class:`Routing`.

    For row ``b`` with ``n`` real tokens (``lengths[b]``; every position without ``lengths``) over ``L`` layers:
    ``aux = E * sum_e (c_e / (L n)) (p_e / (L n))``, where ``c_e`` counts the top-k choices of expert ``e`` and
    ``p_e`` sums its scores, over the row's real tokens in all layers: ``transformers``' ``load_balancing_loss_func``
    given that row alone. Only ``p_e`` carries a gradient.
    """
    b, s, _ = routings[0].probs.shape
    device = routings[0].probs.device
    if lengths is None:
        real = torch.ones(b, s, dtype=torch.float32, device=device)
    else:
        real = (torch.arange(s, device=device) < lengths.to(device).unsqueeze(-1)).float()  # [b, s]
    counts = torch.zeros(b, num_experts, dtype=torch.float32, device=device)
    scores = torch.zeros(b, num_experts, dtype=torch.float32, device=device)
    per_layer = []
    for routing in routings:  # summed layer by layer: nothing of size [layers, b, s, E] is made
        top_k = routing.experts.shape[-1]
        chosen = torch.zeros_like(counts).scatter_add_(
            1, routing.experts.reshape(b, s * top_k), real.repeat_interleave(top_k, dim=1)
        )  # [b, E]
        counts += chosen
        per_layer.append(chosen.sum(dim=0))
        scores = scores + (routing.probs * real.unsqueeze(-1)).sum(dim=1)
    pooled = (len(routings) * real.sum(dim=-1)).clamp(min=1)  # [b]
    aux = num_experts * (counts * scores).sum(dim=-1) / pooled**2
    return RoutingStatistics(aux_loss=aux, tokens_per_expert=torch.stack(per_layer))


def active_shares(model: nn.Module) -> dict[int, float]:
    """By ``id``, every stacked expert parameter of ``model`` (and its adapters') with the ``top_k / num_experts``
    share of it that one token goes through; a parameter not listed is used whole by every token."""
    return {
        id(param): block.top_k / block.num_experts
        for block in model.modules() if isinstance(block, MoEFeedForward)
        for param in block.experts.parameters()
    }


def active_parameter_count(model: nn.Module) -> int:
    """Parameters one token goes through (:func:`active_shares`): all, but of each mixture-of-experts block's experts
    (and their adapters) only the ``top_k / num_experts`` share it is routed to."""
    return round(_values(model, active_shares(model)))


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, counted as values: a stacked projection stored quantized (QLoRA's NF4 experts, a
    module in :class:`GroupedExperts`' place of the parameter) counts the ``[num_experts, out, in]`` values it
    stores, not its codes and scales."""
    return round(_values(model, {}))


def _values(model: nn.Module, shares: dict[int, float]) -> float:
    total, counted = 0.0, set()
    for experts in (m for m in model.modules() if isinstance(m, GroupedExperts)):
        for name in PROJECTIONS:
            stored = getattr(experts, name)
            if isinstance(stored, nn.Module):
                parts = [id(p) for p in stored.parameters()]
                counted.update(parts)
                total += stored.shape.numel() * shares.get(parts[0], 1)
    return total + sum(p.numel() * shares.get(id(p), 1) for p in model.parameters() if id(p) not in counted)
