"""The Phi-3 architecture (Phi-3, Phi-3.5, Phi-4, Phi-4-mini; ``model_type: phi3``) composed from
``toolkit.modules``: Llama's bias-free pre-norm decoder with grouped-query attention, SwiGLU and rotary positions
(Abdin et al., 2024, https://arxiv.org/abs/2412.08905), on part of each head's features (Phi-4-mini) and with
LongRoPE's long context (Phi-3 128k, Phi-3.5-mini, Phi-4-mini) where the checkpoint says so. Hugging Face's
checkpoints fuse ``q/k/v`` into ``qkv_proj`` and gate/up into ``gate_up_proj``; we keep the projections apart (so
adapters, tensor parallelism and memory plans treat them as in every other family) and split or join them in
``_convert_weights``."""

from toolkit.models._decoder import LinearFactory, grouped_query_attention, plain_linear, prenorm_decoder
from toolkit.models.llama3 import llama3_mlp
from toolkit.modules import LongRopeRotaryEmbeddings, LongRopeScaling, RotaryPositionalEmbeddings, TransformerDecoder


def phi3(
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
    rope_base: float = 10_000.0,
    partial_rotary_factor: float = 1.0,
    rope_scaling: LongRopeScaling | None = None,
    tie_word_embeddings: bool = False,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Phi-3 decoder (every projection without bias).

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
        partial_rotary_factor: the share of each head's features that is rotated, the first
            ``int(head_dim * partial_rotary_factor)`` as transformers counts them (Phi-4-mini: 0.75); the rest pass.
        rope_scaling: LongRoPE's frequency factors for long context; ``None``: plain rotary embeddings.
        tie_word_embeddings: reuse the embedding as output projection (Phi-4-mini; Phi-4 has its own).
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    rotary_dim = int(head_dim * partial_rotary_factor)
    if rope_scaling is None:
        rope = RotaryPositionalEmbeddings(head_dim, max_seq_len=max_seq_len, base=rope_base, rotary_dim=rotary_dim)
    else:
        rope = LongRopeRotaryEmbeddings(
            head_dim, max_seq_len=max_seq_len, base=rope_base, scaling=rope_scaling, rotary_dim=rotary_dim,
        )
    return prenorm_decoder(
        vocab_size=vocab_size,
        embed_dim=embed_dim,
        num_layers=num_layers,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        attention=lambda: grouped_query_attention(
            linear, embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
        ),
        mlp=lambda: llama3_mlp(embed_dim=embed_dim, intermediate_dim=intermediate_dim, linear=linear),
        output=None if tie_word_embeddings else lambda: linear("output", embed_dim, vocab_size),
    )
