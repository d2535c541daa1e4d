"""The Llama 3 architecture (also 3.1, 3.2, 3.3) composed from ``toolkit.modules``."""

from collections.abc import Callable

from torch import nn

from toolkit.models._decoder import prenorm_decoder
from toolkit.modules import (
    FeedForward,
    GroupedQueryAttention,
    Llama3RopeScaling,
    RotaryPositionalEmbeddings,
    TransformerDecoder,
)


def llama3_mlp(*, embed_dim: int, intermediate_dim: int) -> FeedForward:
    """SwiGLU feed-forward without biases."""
    return FeedForward(
        gate_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
        down_proj=nn.Linear(intermediate_dim, embed_dim, bias=False),
        up_proj=nn.Linear(embed_dim, intermediate_dim, bias=False),
    )


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
) -> TransformerDecoder:
    """Build a Llama 3 decoder (every projection a plain ``nn.Linear`` without bias).

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
    """
    return _llama3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        rope_base=rope_base,
        rope_scaling=rope_scaling,
        tie_word_embeddings=tie_word_embeddings,
        linear=lambda name, in_dim, out_dim: nn.Linear(in_dim, out_dim, bias=False),
    )


LinearFactory = Callable[[str, int, int], nn.Module]
"""``linear(name, in_dim, out_dim)`` builds one projection; ``name`` is its attribute name (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, or ``output``)."""


def _llama3(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float,
    rope_base: float,
    rope_scaling: Llama3RopeScaling | None,
    tie_word_embeddings: bool,
    linear: LinearFactory,
) -> TransformerDecoder:
    # The architecture, shared by llama3() and the LoRA builders, which differ only in how projections are made.
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base, scaling=rope_scaling)

    def attention() -> GroupedQueryAttention:
        return GroupedQueryAttention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            q_proj=linear("q_proj", embed_dim, num_heads * head_dim),
            k_proj=linear("k_proj", embed_dim, num_kv_heads * head_dim),
            v_proj=linear("v_proj", embed_dim, num_kv_heads * head_dim),
            o_proj=linear("o_proj", num_heads * head_dim, embed_dim),
            pos_embeddings=rope,
        )

    def mlp() -> FeedForward:
        return FeedForward(
            gate_proj=linear("gate_proj", embed_dim, intermediate_dim),
            down_proj=linear("down_proj", intermediate_dim, embed_dim),
            up_proj=linear("up_proj", embed_dim, intermediate_dim),
        )

    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=attention,
        mlp=mlp,
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
    )
