"""The Gemma 2 architecture composed from ``toolkit.modules`` (Gemma Team, 2024, https://arxiv.org/abs/2408.00118).

Against Llama: embeddings scaled by ``sqrt(embed_dim)`` and tied to the output, zero-centred RMSNorms before and
after both attention and MLP, a GeGLU (tanh) MLP, queries scaled by ``query_pre_attn_scalar ** -0.5``, attention
and final logits soft-capped with ``tanh``, and layers alternating local (sliding-window) and global attention.
"""

from torch import nn

from toolkit.models._decoder import LinearFactory, attention_projections, gated_mlp, plain_linear
from toolkit.modules import FeedForward, GroupedQueryAttention, RotaryPositionalEmbeddings
from toolkit.modules.gemma2 import Gemma2DecoderLayer, GemmaRMSNorm, ScaledEmbedding, SoftcappedTransformerDecoder


def gemma2_mlp(*, embed_dim: int, intermediate_dim: int, linear: LinearFactory = plain_linear) -> FeedForward:
    """GeGLU feed-forward (tanh-approximated GELU gate) without biases."""
    return gated_mlp(
        embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear, activation=nn.GELU(approximate="tanh")
    )


def gemma2(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    query_pre_attn_scalar: float,
    norm_eps: float = 1e-6,
    rope_base: float = 10_000.0,
    sliding_window: int | None = 4096,
    attn_logit_softcap: float | None = 50.0,
    final_logit_softcap: float = 30.0,
    linear: LinearFactory = plain_linear,
) -> SoftcappedTransformerDecoder:
    """Build a Gemma 2 decoder.

    Args:
        vocab_size: rows of the (tied) embedding.
        num_layers: decoder layers; even-numbered ones (0, 2, ...) use the sliding window.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: features per head (``num_heads * head_dim`` need not equal ``embed_dim``).
        embed_dim: model width.
        intermediate_dim: feed-forward hidden width.
        max_seq_len: the rotary cache length.
        query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``.
        norm_eps: RMSNorm epsilon.
        rope_base: rotary theta.
        sliding_window: window of the local layers, or ``None`` to make every layer global.
        attn_logit_softcap: cap on attention scores, or ``None``.
        final_logit_softcap: cap on output logits.
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base)
    layers = []
    for i in range(num_layers):
        attn = GroupedQueryAttention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **attention_projections(
                linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
            ),
            pos_embeddings=rope,
            softmax_scale=query_pre_attn_scalar**-0.5,
            sliding_window=sliding_window if i % 2 == 0 else None,
            logit_softcap=attn_logit_softcap,
        )
        layers.append(
            Gemma2DecoderLayer(
                self_attn=attn,
                mlp=gemma2_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear),
                input_layernorm=GemmaRMSNorm(embed_dim, eps=norm_eps),
                post_attention_layernorm=GemmaRMSNorm(embed_dim, eps=norm_eps),
                pre_feedforward_layernorm=GemmaRMSNorm(embed_dim, eps=norm_eps),
                post_feedforward_layernorm=GemmaRMSNorm(embed_dim, eps=norm_eps),
            )
        )
    return SoftcappedTransformerDecoder(
        embed_tokens=ScaledEmbedding(vocab_size, embed_dim, scale=embed_dim**0.5),
        layers=layers,
        norm=GemmaRMSNorm(embed_dim, eps=norm_eps),
        output=None,
        max_seq_len=max_seq_len,
        final_logit_softcap=final_logit_softcap,
    )
