"""The Gemma 3 text architecture composed from ``toolkit.modules`` (Gemma Team, 2025,
https://arxiv.org/abs/2503.19786).

Gemma 2's decoder (scaled and tied embeddings, zero-centred sandwich norms, GeGLU, queries scaled by
``query_pre_attn_scalar ** -0.5``) with three changes: an RMSNorm on each query and key head (QK-norm) in place of
the attention soft-cap, five local (sliding-window) layers for each global one, and a rotary base per kind of layer
(10,000 local; 1,000,000 global, stretched linearly from 4B up). The final soft-cap is gone too.
"""

from toolkit.models._decoder import LinearFactory, grouped_query_attention, plain_linear
from toolkit.models.gemma2 import gemma2_mlp
from toolkit.modules import LinearRopeScaling, RotaryPositionalEmbeddings, TransformerDecoder
from toolkit.modules.gemma2 import Gemma2DecoderLayer, GemmaRMSNorm, ScaledEmbedding, SoftcappedTransformerDecoder


def is_global_layer(index: int, sliding_window_pattern: int) -> bool:
    """Whether layer ``index`` attends globally: every ``sliding_window_pattern``-th layer (5, 11, ... for 6)."""
    return (index + 1) % sliding_window_pattern == 0


def gemma3(
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
    sliding_window: int,
    sliding_window_pattern: int = 6,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    rope_local_base: float = 10_000.0,
    rope_scaling: LinearRopeScaling | None = None,
    attn_logit_softcap: float | None = None,
    final_logit_softcap: float | None = None,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Gemma 3 text decoder.

    Args:
        vocab_size: rows of the (tied) embedding.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: features per head (``num_heads * head_dim`` need not equal ``embed_dim``).
        embed_dim: model width.
        intermediate_dim: feed-forward hidden width.
        max_seq_len: the rotary caches' length.
        query_pre_attn_scalar: attention scores are scaled by ``query_pre_attn_scalar ** -0.5``.
        sliding_window: window of the local layers.
        sliding_window_pattern: every this-many-th layer is global (:func:`is_global_layer`), the others local; at
            least 2, so that the first layer is local.
        norm_eps: epsilon of every RMSNorm, the per-head q/k norms included.
        rope_base: rotary theta of the global layers.
        rope_local_base: rotary theta of the local layers.
        rope_scaling: frequency scaling of the global layers' rotary embedding (the local ones have none).
        attn_logit_softcap: cap on attention scores (``None`` in every release).
        final_logit_softcap: cap on output logits (``None`` in every release).
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    if sliding_window_pattern < 2:
        raise ValueError(f"sliding_window_pattern must be at least 2, got {sliding_window_pattern}")
    ropes = {
        False: RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_local_base),
        True: RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base, scaling=rope_scaling),
    }
    layers = []
    for i in range(num_layers):
        is_global = is_global_layer(i, sliding_window_pattern)
        attn = grouped_query_attention(
            linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            rope=ropes[is_global], q_norm=GemmaRMSNorm(head_dim, eps=norm_eps),
            k_norm=GemmaRMSNorm(head_dim, eps=norm_eps),
            softmax_scale=query_pre_attn_scalar**-0.5, sliding_window=None if is_global else sliding_window,
            logit_softcap=attn_logit_softcap,
        )
        norms = {name: GemmaRMSNorm(embed_dim, eps=norm_eps) for name in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")}
        mlp = gemma2_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear)
        layers.append(Gemma2DecoderLayer(self_attn=attn, mlp=mlp, **norms))
    decoder = dict(
        embed_tokens=ScaledEmbedding(vocab_size, embed_dim, scale=embed_dim**0.5),
        layers=layers,
        norm=GemmaRMSNorm(embed_dim, eps=norm_eps),
        output=None,
        max_seq_len=max_seq_len,
    )
    if final_logit_softcap is None:
        return TransformerDecoder(**decoder)
    return SoftcappedTransformerDecoder(final_logit_softcap=final_logit_softcap, **decoder)
