"""Public Llama 2 sizes (numbers from Meta's params.json and the Hugging Face config.json of each release).

Llama 2 checkpoints on the Hugging Face hub say ``model_type: llama``; :func:`toolkit.pretrained.from_pretrained`
builds them with the ``llama3`` family, whose builder covers this architecture.
"""

from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.llama2._component_builders import llama2
from toolkit.modules import TransformerDecoder

_LLAMA2_VOCAB = 32_000


def llama2_7b(*, max_seq_len: int = 4096, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 2 7B."""
    return llama2(
        vocab_size=_LLAMA2_VOCAB, num_layers=32, num_heads=32, num_kv_heads=32, embed_dim=4096, intermediate_dim=11_008,
        max_seq_len=max_seq_len, linear=linear,
    )


def llama2_13b(*, max_seq_len: int = 4096, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 2 13B."""
    return llama2(
        vocab_size=_LLAMA2_VOCAB, num_layers=40, num_heads=40, num_kv_heads=40, embed_dim=5120, intermediate_dim=13_824,
        max_seq_len=max_seq_len, linear=linear,
    )


def llama2_70b(*, max_seq_len: int = 4096, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 2 70B."""
    return llama2(
        vocab_size=_LLAMA2_VOCAB, num_layers=80, num_heads=64, num_kv_heads=8, embed_dim=8192, intermediate_dim=28_672,
        max_seq_len=max_seq_len, linear=linear,
    )
