"""Model building blocks: attention, position embeddings, norms, feed-forward, the decoder, the KV cache, and the
model contract every model implements (:mod:`toolkit.modules.contract`)."""

from toolkit.modules.attention import DocumentMasks, GroupedQueryAttention
from toolkit.modules.contract import DecoderLayers, DecoderModel
from toolkit.modules.feed_forward import FeedForward
from toolkit.modules.kv_cache import KVCache
from toolkit.modules.position_embeddings import (
    LinearRopeScaling,
    Llama3RopeScaling,
    LongRopeRotaryEmbeddings,
    LongRopeScaling,
    RotaryPositionalEmbeddings,
    YarnRopeScaling,
)
from toolkit.modules.rms_norm import RMSNorm
from toolkit.modules.transformer import TransformerDecoder, TransformerDecoderLayer

__all__ = [
    "DecoderLayers",
    "DecoderModel",
    "DocumentMasks",
    "FeedForward",
    "GroupedQueryAttention",
    "KVCache",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "LongRopeRotaryEmbeddings",
    "LongRopeScaling",
    "RMSNorm",
    "RotaryPositionalEmbeddings",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "YarnRopeScaling",
]
