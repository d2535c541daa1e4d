"""Mixture-of-experts feed-forward: a top-k router and grouped, dropless experts (Shazeer et al., 2017,
https://arxiv.org/abs/1701.06538; Mixtral, https://arxiv.org/abs/2401.04088; Qwen3, https://arxiv.org/abs/2505.09388).

The experts' weights are stacked, ``[num_experts, out, in]`` per projection, so that all the tokens routed to every
expert go through one grouped matrix multiply per projection (``torch._grouped_mm`` where the device has it, an
exact per-expert fallback elsewhere): no Python loop over tokens, and no token dropped for capacity.

The load-balancing loss (Switch Transformer, https://arxiv.org/abs/2101.03961, eq. 4-6, as ``transformers``
computes it for Mixtral and Qwen3-MoE, pooled over the MoE layers) is taken per row of the batch, over its real
(unpadded) tokens: for a batch of one row it is ``transformers``' value, and since no row's statistics depend on
the others, the total over a global batch is the same whatever its split into ranks and micro-batches.
"""

from dataclasses import dataclass
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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Scores ``[t, num_experts]`` (float32 softmax), and each token's kept weights and experts ``[t, top_k]``
        (the weights in ``x``'s dtype) for tokens ``x`` ``[t, dim]``."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
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
    autograd graph) and the chosen experts ``[b, s, top_k]``."""

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

    @property
    def num_experts(self) -> int:
        return self.gate.num_experts

    @property
    def top_k(self) -> int:
        return self.gate.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        tokens = x.reshape(-1, dim)
        probs, weights, experts = self.gate(tokens)
        self.routing = Routing(probs.view(b, s, -1), experts.view(b, s, -1))
        out = self.experts(tokens, experts, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        return out.view(b, s, dim)


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
