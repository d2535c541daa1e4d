"""Public Llama 3.x sizes (numbers from each release's params/config) and a tiny demo size."""

from toolkit.models.llama3._component_builders import llama3
from toolkit.modules import Llama3RopeScaling, TransformerDecoder

_LLAMA3_VOCAB = 128_256


def llama3_demo(*, vocab_size: int = 384, max_seq_len: int = 256) -> TransformerDecoder:
    """A ~1M-parameter Llama 3 for the CPU demo and tests (byte-level vocabulary)."""
    return llama3(
        vocab_size=vocab_size,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        embed_dim=128,
        intermediate_dim=384,
        max_seq_len=max_seq_len,
        rope_base=10_000.0,
    )


def llama3_2_1b(*, max_seq_len: int = 131_072) -> TransformerDecoder:
    """Llama 3.2 1B."""
    return llama3(
        vocab_size=_LLAMA3_VOCAB,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=2048,
        intermediate_dim=8192,
        max_seq_len=max_seq_len,
        rope_scaling=Llama3RopeScaling(factor=32.0),
        tie_word_embeddings=True,
    )


def llama3_2_3b(*, max_seq_len: int = 131_072) -> TransformerDecoder:
    """Llama 3.2 3B."""
    return llama3(
        vocab_size=_LLAMA3_VOCAB,
        num_layers=28,
        num_heads=24,
        num_kv_heads=8,
        embed_dim=3072,
        intermediate_dim=8192,
        max_seq_len=max_seq_len,
        rope_scaling=Llama3RopeScaling(factor=32.0),
        tie_word_embeddings=True,
    )


def llama3_1_8b(*, max_seq_len: int = 131_072) -> TransformerDecoder:
    """Llama 3.1 8B."""
    return llama3(
        vocab_size=_LLAMA3_VOCAB,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        embed_dim=4096,
        intermediate_dim=14_336,
        max_seq_len=max_seq_len,
        rope_scaling=Llama3RopeScaling(factor=8.0),
    )


def llama3_1_70b(*, max_seq_len: int = 131_072) -> TransformerDecoder:
    """Llama 3.1 70B."""
    return llama3(
        vocab_size=_LLAMA3_VOCAB,
        num_layers=80,
        num_heads=64,
        num_kv_heads=8,
        embed_dim=8192,
        intermediate_dim=28_672,
        max_seq_len=max_seq_len,
        rope_scaling=Llama3RopeScaling(factor=8.0),
    )
