"""The pieces the families' builders share: how a projection is made (so that a LoRA builder reuses the plain
architecture, changing only its projections), the attention projections, the gated MLP, the mixture-of-experts
feed-forward, and the pre-norm decoder layout that Llama, Mistral and Qwen share. Each family passes its own blocks."""

from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from toolkit.modules import (
    FeedForward,
    GroupedQueryAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
    TransformerDecoderLayer,
)
from toolkit.modules.moe import GroupedExperts, MoEFeedForward, TopKRouter

LinearFactory = Callable[..., nn.Module]
"""``linear(name, in_dim, out_dim, *, bias=False)`` builds one projection; ``name`` is its attribute name
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, or ``output``).
Builders take one as ``linear=``: :func:`plain_linear` for the plain model, ``toolkit.models._lora.lora_linear``
for adapters. A factory that adapts mixture-of-experts blocks too has a ``make_experts`` attribute
(:func:`grouped_experts`), and one that trains their routers a ``make_router`` attribute (:func:`top_k_router`)."""


def plain_linear(name: str, in_dim: int, out_dim: int, *, bias: bool = False) -> nn.Linear:
    """A plain ``nn.Linear`` whatever the projection's name: the default of every builder's ``linear``."""
    return nn.Linear(in_dim, out_dim, bias=bias)


def grouped_experts(linear: LinearFactory, *, num_experts: int, dim: int, hidden_dim: int) -> GroupedExperts:
    """A mixture-of-experts block's stacked experts: ``linear.make_experts(...)`` where the factory adapts experts
    (``lora_linear(apply_lora_to_experts=True)``), else plain :class:`~toolkit.modules.moe.GroupedExperts`."""
    make = getattr(linear, "make_experts", None)
    if make is not None:
        return make(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim)
    return GroupedExperts(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim)


def top_k_router(linear: LinearFactory, *, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> TopKRouter:
    """A mixture-of-experts block's router: ``linear.make_router(...)`` where the factory trains routers
    (``lora_linear(train_router=True)``), else a plain :class:`~toolkit.modules.moe.TopKRouter`."""
    make = getattr(linear, "make_router", TopKRouter)
    return make(dim, num_experts, top_k, norm_topk_prob=norm_topk_prob)


def attention_projections(
    linear: LinearFactory, *, embed_dim: int, num_heads: int, num_kv_heads: int, head_dim: int, qkv_bias: bool = False
) -> dict[str, nn.Module]:
    """``q_proj``, ``k_proj``, ``v_proj`` (biased with ``qkv_bias``, as in Qwen2) and ``o_proj`` (never biased), as
    keyword arguments of :class:`~toolkit.modules.GroupedQueryAttention`."""
    return {
        "q_proj": linear("q_proj", embed_dim, num_heads * head_dim, bias=qkv_bias),
        "k_proj": linear("k_proj", embed_dim, num_kv_heads * head_dim, bias=qkv_bias),
        "v_proj": linear("v_proj", embed_dim, num_kv_heads * head_dim, bias=qkv_bias),
        "o_proj": linear("o_proj", num_heads * head_dim, embed_dim),
    }


def grouped_query_attention(
    linear: LinearFactory,
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: RotaryPositionalEmbeddings,
    **options: Any,
) -> GroupedQueryAttention:
    """Bias-free grouped-query attention with rotary positions; ``options`` are the family's own
    :class:`~toolkit.modules.GroupedQueryAttention` arguments (``q_norm``, ``sliding_window``...)."""
    return GroupedQueryAttention(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        **attention_projections(
            linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
        ),
        pos_embeddings=rope,
        **options,
    )


def gated_mlp(
    *, embed_dim: int, intermediate_dim: int, linear: LinearFactory = plain_linear, activation: nn.Module | None = None
) -> FeedForward:
    """A gated feed-forward without biases: SwiGLU by default, or the gate ``activation`` given (Gemma: GELU)."""
    return FeedForward(
        gate_proj=linear("gate_proj", embed_dim, intermediate_dim),
        down_proj=linear("down_proj", intermediate_dim, embed_dim),
        up_proj=linear("up_proj", embed_dim, intermediate_dim),
        activation=activation,
    )


def moe_mlp(
    *,
    embed_dim: int,
    hidden_dim: int,
    num_experts: int,
    num_experts_per_tok: int,
    norm_topk_prob: bool,
    linear: LinearFactory = plain_linear,
) -> MoEFeedForward:
    """A mixture-of-experts feed-forward of SwiGLU experts without biases, routed top-k (Mixtral, Qwen3-MoE).

    The router is never adapted (:func:`top_k_router`: trained whole by a LoRA factory with ``train_router``); the
    experts are made by :func:`grouped_experts` from ``linear`` (adapted by a LoRA factory with
    ``apply_lora_to_experts``).
    """
    return MoEFeedForward(
        gate=top_k_router(linear, dim=embed_dim, num_experts=num_experts, top_k=num_experts_per_tok,
                          norm_topk_prob=norm_topk_prob),
        experts=grouped_experts(linear, num_experts=num_experts, dim=embed_dim, hidden_dim=hidden_dim),
    )


def prenorm_decoder(
    *,
    vocab_size: int,
    embed_dim: int,
    num_layers: int,
    max_seq_len: int,
    norm_eps: float,
    attention: Callable[[], nn.Module],
    mlp: Callable[[], nn.Module] | Sequence[Callable[[], nn.Module]],
    output: Callable[[], nn.Module] | None,
    router_aux_loss_coef: float = 0.0,
) -> TransformerDecoder:
    """``num_layers`` layers of ``x + attention(norm(x))`` then ``h + mlp(norm(h))``, RMSNorms throughout.

    Args:
        vocab_size: rows of the embedding.
        embed_dim: model width.
        num_layers: decoder layers.
        max_seq_len: the longest sequence the position embeddings support.
        norm_eps: epsilon of every RMSNorm.
        attention: builds one layer's attention (called once per layer, in order).
        mlp: builds one layer's feed-forward; or one builder per layer, in order, where layers differ (Qwen3-MoE's
            dense layers among its mixture-of-experts ones).
        output: builds the output projection; ``None`` ties it to the embedding.
        router_aux_loss_coef: weight of the mixture-of-experts layers' load-balancing loss in the training loss.
    """
    mlps = [mlp] * num_layers if callable(mlp) else list(mlp)
    if len(mlps) != num_layers:
        raise ValueError(f"mlp: {len(mlps)} builders for {num_layers} layers")
    layers = [
        TransformerDecoderLayer(
            self_attn=attention(),
            mlp=layer_mlp(),
            input_layernorm=RMSNorm(embed_dim, eps=norm_eps),
            post_attention_layernorm=RMSNorm(embed_dim, eps=norm_eps),
        )
        for layer_mlp in mlps
    ]
    return TransformerDecoder(
        embed_tokens=nn.Embedding(vocab_size, embed_dim),
        layers=layers,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output() if output is not None else None,
        max_seq_len=max_seq_len,
        router_aux_loss_coef=router_aux_loss_coef,
    )
