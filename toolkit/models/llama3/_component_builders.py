"""The Llama 3 architecture (also 3.1, 3.2, 3.3) composed from ``toolkit.modules``."""

from toolkit.models._decoder import LinearFactory, attention_projections, gated_mlp, plain_linear, prenorm_decoder
from toolkit.modules import (
    FeedForward,
    GroupedQueryAttention,
    Llama3RopeScaling,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
)


def llama3_mlp(*, embed_dim: int, intermediate_dim: int, linear: LinearFactory = plain_linear) -> FeedForward:
    """SwiGLU feed-forward without biases."""
    return gated_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear)


def llama3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-5,
    rope_base: float = 500_000.0,
    rope_scaling: Llama3RopeScaling | None = None,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Llama 3 decoder (every projection without bias).

    Args:
        vocab_size: rows of the embedding and of the output projection.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (grouped-query attention).
        embed_dim: model width; ``head_dim = embed_dim // num_heads``.
        intermediate_dim: feed-forward hidden width.
        max_seq_len: the rotary cache length.
        norm_eps: RMSNorm epsilon.
        rope_base: rotary theta.
        rope_scaling: Llama 3.1's frequency scaling, or ``None`` (Llama 3.0).
        tie_word_embeddings: reuse the embedding as output projection (Llama 3.2 1B and 3B).
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base, scaling=rope_scaling)

    def attention() -> GroupedQueryAttention:
        return GroupedQueryAttention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **attention_projections(
                linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
            ),
            pos_embeddings=rope,
        )

    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=attention,
        mlp=lambda: llama3_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear),
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
    )
