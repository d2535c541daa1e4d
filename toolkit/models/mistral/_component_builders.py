"""The Mistral 7B architecture composed from ``toolkit.modules`` (Jiang et al., 2023,
https://arxiv.org/abs/2310.06825): Llama's decoder with grouped-query attention, an explicit head_dim, and
optional sliding-window attention on every layer (v0.1 only; v0.2 and v0.3 attend to the full context)."""

from toolkit.models._decoder import LinearFactory, grouped_query_attention, plain_linear, prenorm_decoder
from toolkit.models.llama3 import llama3_mlp
from toolkit.modules import GroupedQueryAttention, RotaryPositionalEmbeddings, TransformerDecoder


def mistral_attention(
    *,
    embed_dim: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope: RotaryPositionalEmbeddings,
    sliding_window: int | None,
    linear: LinearFactory = plain_linear,
) -> GroupedQueryAttention:
    """Mistral's attention (also Mixtral's): grouped-query, bias-free, over a sliding window if one is given."""
    return grouped_query_attention(
        linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
        sliding_window=sliding_window,
    )


def mistral(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-5,
    rope_base: float = 1_000_000.0,
    sliding_window: int | None = None,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Mistral decoder.

    Args:
        vocab_size: rows of the embedding and of the output projection.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        head_dim: features per head.
        embed_dim: model width.
        intermediate_dim: feed-forward hidden width.
        max_seq_len: the rotary cache length.
        norm_eps: RMSNorm epsilon.
        rope_base: rotary theta.
        sliding_window: attention window of every layer, or ``None`` for full attention.
        tie_word_embeddings: reuse the embedding as output projection.
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base)
    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=lambda: mistral_attention(
            embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
            sliding_window=sliding_window, linear=linear,
        ),
        mlp=lambda: llama3_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear),
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
    )
