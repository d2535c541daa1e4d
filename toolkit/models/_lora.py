"""Low-rank adapters for any family: LoRA (Hu et al., 2021), DoRA (Liu et al., 2024) and QLoRA (Dettmers et al.,
2023) versions of the families' builders.

Every family builder and size in ``toolkit.models`` takes ``linear=``, the factory that makes its projections (see
``toolkit.models._decoder.LinearFactory``). :func:`lora_linear` is the factory that makes adapter layers, and
:func:`lora_builder` turns a family's builder into its LoRA builder: the same architecture, the same state-dict keys
for the base weights (``layers.0.self_attn.q_proj.weight``, so a base checkpoint loads unchanged), plus adapters
(``...q_proj.lora_a.weight``, ``...q_proj.lora_b.weight`` and DoRA's ``...q_proj.magnitude``). A family adds LoRA
with one line per builder, and every family takes the same LoRA arguments.
"""

import inspect
from collections.abc import Callable, Sequence
from functools import partial
from typing import Annotated, Any, TypeVar

from torch import nn

from toolkit.config import Float, Int
from toolkit.errors import UserError
from toolkit.models._decoder import LinearFactory
from toolkit.modules.moe import GroupedExperts
from toolkit.modules.peft import DoRALinear, LoRAGroupedExperts, LoRALinear, NF4Linear, TrainedRouter
from toolkit.modules.peft.nf4 import NF4_BLOCK_SIZE
from toolkit.modules.peft.nf4_experts import quantize_experts_

ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")

Model = TypeVar("Model", bound=nn.Module)


def lora_linear(
    *,
    lora_attn_modules: Sequence[str],
    apply_lora_to_mlp: bool = False,
    apply_lora_to_output: bool = False,
    apply_lora_to_experts: bool = False,
    train_router: bool = False,
    lora_rank: Annotated[int, Int(ge=1)] = 8,
    lora_alpha: Annotated[float, Float(gt=0)] = 16,
    lora_dropout: Annotated[float, Float(ge=0, lt=1)] = 0.0,
    use_dora: bool = False,
    quantize_base: bool = False,
    lora_target_modules: Sequence[str] = (),
) -> LinearFactory:
    """The projection factory of a LoRA, DoRA or QLoRA model: adapter layers on the chosen projections.

    Args:
        lora_attn_modules: attention projections to adapt, a subset of ``q_proj``, ``k_proj``, ``v_proj``,
            ``o_proj``.
        apply_lora_to_mlp: adapt the feed-forward's ``gate_proj``, ``up_proj`` and ``down_proj``.
        apply_lora_to_output: adapt the output projection (not possible with tied embeddings).
        apply_lora_to_experts: adapt every expert of the mixture-of-experts blocks (each projection of each expert
            its own adapter, :class:`~toolkit.modules.peft.LoRAGroupedExperts`).
        train_router: train the mixture-of-experts blocks' routers whole, next to the adapters
            (:class:`~toolkit.modules.peft.TrainedRouter`); false: they stay frozen.
        lora_rank: adapter rank ``r``.
        lora_alpha: adapter outputs are scaled by ``lora_alpha / lora_rank``.
        lora_dropout: dropout on the adapters' input.
        use_dora: DoRA (learned magnitude) instead of LoRA.
        quantize_base: QLoRA: every decoder-layer projection's frozen weight is stored in NF4, adapted or not
            (Dettmers et al., 2023 quantize all linear layers of the base), the experts of mixture-of-experts blocks
            too (:class:`~toolkit.modules.peft.NF4Stack`, one quantization per expert); the embedding, norms, biases,
            routers and an unadapted output projection keep the model dtype.
        lora_target_modules: further linear layers to adapt, by attribute name, whatever the architecture calls
            them (the transformers backend's ``query_key_value``, ``dense``, ``fc1``...); each must name one.

    Raises:
        UserError: an unknown attention module, or nothing to adapt.
    """
    unknown = sorted(set(lora_attn_modules) - set(ATTN_MODULES))
    if unknown:
        raise UserError(f"lora_attn_modules: unknown {unknown}; choose from {list(ATTN_MODULES)}")
    adapted = set(lora_attn_modules) | set(lora_target_modules) | (set(MLP_MODULES) if apply_lora_to_mlp else set())
    if apply_lora_to_output:
        adapted.add("output")
    if not adapted and not apply_lora_to_experts:
        raise UserError(
            "no adapters: set lora_attn_modules, lora_target_modules, apply_lora_to_mlp, apply_lora_to_output or "
            "apply_lora_to_experts"
        )
    if apply_lora_to_experts and use_dora:
        raise UserError("use_dora: DoRA is not available on experts; set apply_lora_to_experts false or use LoRA")
    adapter_cls = DoRALinear if use_dora else LoRALinear

    def linear(name: str, in_dim: int, out_dim: int, *, bias: bool = False) -> nn.Module:
        if name in adapted:
            return adapter_cls(
                in_dim, out_dim, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout, use_bias=bias,
                quantize_base=quantize_base,
            )
        if quantize_base and name != "output":
            return NF4Linear(in_dim, out_dim, use_bias=bias)
        return nn.Linear(in_dim, out_dim, bias=bias)

    def make_experts(*, num_experts: int, dim: int, hidden_dim: int) -> nn.Module:
        if apply_lora_to_experts:
            experts = LoRAGroupedExperts(
                num_experts=num_experts, dim=dim, hidden_dim=hidden_dim, rank=lora_rank, alpha=lora_alpha,
                dropout=lora_dropout,
            )
        else:
            experts = GroupedExperts(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim)
        if quantize_base:  # the experts are nearly all of an MoE model's weights: NF4 too, one expert at a time
            if (dim * hidden_dim) % NF4_BLOCK_SIZE:
                raise UserError(f"quantize_base: an expert's {hidden_dim} x {dim} matrices are not a multiple of NF4's "
                                f"{NF4_BLOCK_SIZE}-value blocks; use LoRA")
            quantize_experts_(experts)
        return experts

    linear.make_experts = make_experts
    if train_router:
        linear.make_router = TrainedRouter
    return linear


_LORA_PARAMS = inspect.signature(lora_linear).parameters


def lora_builder(builder: Callable[..., Model]) -> Callable[..., Model]:
    """The LoRA version of ``builder`` (any builder taking ``linear=``: a family's component builder or a size).

    The result takes :func:`lora_linear`'s arguments and ``builder``'s own (less ``linear``), all by keyword, and
    its signature says so, so configs are validated against it like any builder's.

    Args:
        builder: e.g. ``qwen2_5`` or ``qwen2_5_7b``; the result is named ``lora_qwen2_5`` or ``lora_qwen2_5_7b``.

    Raises:
        TypeError: ``builder`` takes no ``linear``, or takes an argument named like one of :func:`lora_linear`'s.
    """
    signature = inspect.signature(builder)
    if "linear" not in signature.parameters or _LORA_PARAMS.keys() & signature.parameters.keys():
        raise TypeError(f"{builder.__name__} must take `linear` and none of lora_linear's arguments")
    base_params = [param for param in signature.parameters.values() if param.name != "linear"]

    def build(**kwargs: Any) -> Model:
        lora = {key: kwargs.pop(key) for key in list(kwargs) if key in _LORA_PARAMS}
        model = builder(**kwargs, linear=lora_linear(**lora))
        _check_targets(model, lora.get("lora_target_modules") or ())
        if lora.get("apply_lora_to_experts") and not any(isinstance(m, LoRAGroupedExperts) for m in model.modules()):
            raise UserError(f"apply_lora_to_experts: {builder.__name__} has no mixture-of-experts layers; set it false")
        if lora.get("train_router") and not any(isinstance(m, TrainedRouter) for m in model.modules()):
            raise UserError(f"train_router: {builder.__name__} has no mixture-of-experts layers; set it false")
        # A tied output projection is the embedding, never made by `linear`: an output adapter has nowhere to go.
        if lora.get("apply_lora_to_output") and not isinstance(model.output_projection(), LoRALinear):
            raise UserError(
                "apply_lora_to_output: this model ties its output projection to the embedding; set it false"
            )
        # Mixture-of-experts feed-forwards have no projections made by `linear`: no adapter would be placed.
        if lora.get("apply_lora_to_mlp") and not any(
            isinstance(module, LoRALinear) and ".mlp." in name for name, module in model.named_modules()
        ):
            raise UserError(
                "apply_lora_to_mlp: this model's feed-forwards are mixtures of experts, which take no adapters; "
                "set it false"
            )
        return model

    parameters = [*_LORA_PARAMS.values(), *base_params]
    build.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = f"lora_{builder.__name__}"
    build.__module__ = builder.__module__.rpartition(".")[0]  # the family package, which exports it
    summary = (inspect.getdoc(builder) or builder.__name__).splitlines()[0].rstrip(".")
    build.__doc__ = (
        f"{summary}, with LoRA/DoRA adapters (QLoRA with ``quantize_base=True``).\n\n"
        f"Arguments: the adapters' (:func:`toolkit.models._lora.lora_linear`) and the architecture's "
        f"(:func:`{builder.__name__}`), by keyword."
    )
    return build


def _check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Refuse ``lora_target_modules`` names that no adapter layer of ``model`` took (a typo adapts nothing)."""
    adapted = {name.rpartition(".")[2] for name, module in model.named_modules() if isinstance(module, LoRALinear)}
    missing = sorted(set(targets) - adapted)
    if missing:
        linear = {name.rpartition(".")[2] for name, module in model.named_modules()
                  if isinstance(module, (nn.Linear, LoRALinear, NF4Linear)) and name}
        raise UserError(
            f"lora_target_modules: {missing} match no linear layer of the model; its linear layers are named "
            f"{sorted(linear)}"
        )


def qlora(builder: Callable[..., Model]) -> Callable[..., Model]:
    """A QLoRA builder: the LoRA ``builder`` (``lora_qwen2_5_7b``) with ``quantize_base=True``, named
    ``qlora_qwen2_5_7b`` (a partial keeps the signature that config validation checks against)."""
    qlora_builder = partial(builder, quantize_base=True)
    qlora_builder.__doc__ = f"QLoRA: :func:`{builder.__name__}` with ``quantize_base=True`` (NF4 base weights)."
    qlora_builder.__name__ = f"q{builder.__name__}"  # type: ignore[attr-defined]
    return qlora_builder
