"""The Qwen2 / Qwen2.5 architecture composed from ``toolkit.modules``: Llama's decoder with biases on the
query, key and value projections (Qwen Team, 2024, https://arxiv.org/abs/2412.15115)."""

from toolkit.models._decoder import LinearFactory, attention_projections, plain_linear, prenorm_decoder
from toolkit.models.llama3 import llama3_mlp
from toolkit.modules import GroupedQueryAttention, RotaryPositionalEmbeddings, TransformerDecoder


def qwen2_5(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int,
    norm_eps: float = 1e-6,
    rope_base: float = 1_000_000.0,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Qwen2.5 decoder.

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
        tie_word_embeddings: reuse the embedding as output projection (0.5B, 1.5B, 3B).
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base)

    def attention() -> GroupedQueryAttention:
        return GroupedQueryAttention(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            **attention_projections(
                linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                qkv_bias=True,
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
