"""The Qwen3 dense architecture composed from ``toolkit.modules``: Llama's decoder with an RMSNorm on each query
and key head before the rotary embedding, and a head_dim set independently of the width (Qwen Team, 2025,
https://arxiv.org/abs/2505.09388)."""

from toolkit.models._decoder import LinearFactory, grouped_query_attention, plain_linear, prenorm_decoder
from toolkit.models.llama3 import llama3_mlp
from toolkit.modules import (
    GroupedQueryAttention,
    RMSNorm,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
    YarnRopeScaling,
)


def qwen3_attention(
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: RotaryPositionalEmbeddings,
    norm_eps: float,
    linear: LinearFactory = plain_linear,
) -> GroupedQueryAttention:
    """Qwen3's attention (dense and MoE): grouped-query, bias-free, with an RMSNorm on each query and key head."""
    return grouped_query_attention(
        linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
        q_norm=RMSNorm(head_dim, eps=norm_eps), k_norm=RMSNorm(head_dim, eps=norm_eps),
    )


def qwen3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    rope_scaling: YarnRopeScaling | None = None,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Qwen3 dense decoder.

    Args:
        vocab_size: rows of the embedding and of the output projection.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: features per head (128 at every public size, whatever the width).
        embed_dim: model width.
        intermediate_dim: feed-forward hidden width.
        max_seq_len: the rotary cache length.
        norm_eps: epsilon of every RMSNorm, the per-head q/k norms included.
        rope_base: rotary theta.
        rope_scaling: YaRN, for sequences longer than the 32,768 positions Qwen3 was trained at.
        tie_word_embeddings: reuse the embedding as output projection (0.6B, 1.7B, 4B).
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base, scaling=rope_scaling)
    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=lambda: qwen3_attention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
            norm_eps=norm_eps, linear=linear,
        ),
        mlp=lambda: llama3_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear),
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
    )
