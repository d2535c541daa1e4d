"""The pre-norm decoder layout that Llama, Mistral and Qwen share; each family passes its own blocks."""

from collections.abc import Callable

from torch import nn

from toolkit.modules import RMSNorm, TransformerDecoder, TransformerDecoderLayer


def prenorm_decoder(
    *,
    vocab_size: int,
    embed_dim: int,
    num_layers: int,
    max_seq_len: int,
    norm_eps: float,
    attention: Callable[[], nn.Module],
    mlp: Callable[[], nn.Module],
    output: Callable[[], nn.Module] | None,
) -> TransformerDecoder:
    """``num_layers`` layers of ``x + attention(norm(x))`` then ``h + mlp(norm(h))``, RMSNorms throughout.

    Args:
        vocab_size: rows of the embedding.
        embed_dim: model width.
        num_layers: decoder layers.
        max_seq_len: the longest sequence the position embeddings support.
        norm_eps: epsilon of every RMSNorm.
        attention: builds one layer's attention (called once per layer, in order).
        mlp: builds one layer's feed-forward.
        output: builds the output projection; ``None`` ties it to the embedding.
    """
    layers = [
        TransformerDecoderLayer(
            self_attn=attention(),
            mlp=mlp(),
            input_layernorm=RMSNorm(embed_dim, eps=norm_eps),
            post_attention_layernorm=RMSNorm(embed_dim, eps=norm_eps),
        )
        for _ in range(num_layers)
    ]
    return TransformerDecoder(
        embed_tokens=nn.Embedding(vocab_size, embed_dim),
        layers=layers,
        norm=RMSNorm(embed_dim, eps=norm_eps),
        output=output() if output is not None else None,
        max_seq_len=max_seq_len,
    )
