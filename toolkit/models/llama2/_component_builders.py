"""The Llama 2 architecture (Touvron et al., 2023, https://arxiv.org/abs/2307.09288).

It is the decoder Llama 3 kept: the differences are numbers (rotary base 10,000, a 32,000-token vocabulary,
4,096 positions), so the builder is Llama 3's with Llama 2's defaults.
"""

from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.llama3 import llama3
from toolkit.modules import TransformerDecoder


def llama2(
    *,
    vocab_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    embed_dim: int,
    intermediate_dim: int,
    max_seq_len: int = 4096,
    norm_eps: float = 1e-5,
    rope_base: float = 10_000.0,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Build a Llama 2 decoder.

    Args:
        vocab_size: rows of the embedding and of the output projection.
        num_layers: decoder layers.
        num_heads: query heads.
        num_kv_heads: key/value heads (equal to ``num_heads`` except for 70B's grouped-query attention).
        embed_dim: model width; ``head_dim = embed_dim // num_heads``.
        intermediate_dim: feed-forward hidden width.
        max_seq_len: the rotary cache length.
        norm_eps: RMSNorm epsilon.
        rope_base: rotary theta.
        linear: makes each projection (plain ``nn.Linear`` by default; the LoRA builders pass adapter layers).
    """
    return llama3(
        vocab_size=vocab_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        embed_dim=embed_dim,
        intermediate_dim=intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=norm_eps,
        rope_base=rope_base,
        linear=linear,
    )
