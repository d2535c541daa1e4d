"""Public Qwen2.5 sizes (numbers from each release's config.json) and any size read from a Hugging Face
``config.json``."""

from functools import partial
from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.qwen2_5._component_builders import qwen2_5
from toolkit.modules import TransformerDecoder

# Qwen2 and Qwen2.5 checkpoints both say "qwen2".
HF_MODEL_TYPES: tuple[str, ...] = ("qwen2",)

# The small sizes have a 151,936-row embedding tied to the output; from 7B on it is untied and padded to 152,064.
_small = partial(qwen2_5, vocab_size=151_936, tie_word_embeddings=True)
_large = partial(qwen2_5, vocab_size=152_064)


def qwen2_5_0_5b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 0.5B."""
    return _small(
        num_layers=24, num_heads=14, num_kv_heads=2, embed_dim=896, intermediate_dim=4864, max_seq_len=max_seq_len,
        linear=linear,
    )


def qwen2_5_1_5b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 1.5B."""
    return _small(
        num_layers=28, num_heads=12, num_kv_heads=2, embed_dim=1536, intermediate_dim=8960,
        max_seq_len=max_seq_len, linear=linear,
    )


def qwen2_5_3b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 3B."""
    return _small(
        num_layers=36, num_heads=16, num_kv_heads=2, embed_dim=2048, intermediate_dim=11_008,
        max_seq_len=max_seq_len, linear=linear,
    )


def qwen2_5_7b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 7B."""
    return _large(
        num_layers=28, num_heads=28, num_kv_heads=4, embed_dim=3584, intermediate_dim=18_944,
        max_seq_len=max_seq_len, linear=linear,
    )


def qwen2_5_14b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 14B."""
    return _large(
        num_layers=48, num_heads=40, num_kv_heads=8, embed_dim=5120, intermediate_dim=13_824,
        max_seq_len=max_seq_len, linear=linear,
    )


def qwen2_5_32b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 32B."""
    return _large(
        num_layers=64, num_heads=40, num_kv_heads=8, embed_dim=5120, intermediate_dim=27_648,
        max_seq_len=max_seq_len, linear=linear,
    )


def qwen2_5_72b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Qwen2.5 72B."""
    return _large(
        num_layers=80, num_heads=64, num_kv_heads=8, embed_dim=8192, intermediate_dim=29_568,
        max_seq_len=max_seq_len, linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Qwen2.5 with the dimensions of a Hugging Face ``Qwen2ForCausalLM`` ``config.json`` (as a dict).

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: sliding-window layers, rotary scaling or an activation other than SiLU, which no released
            Qwen2.5 uses.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if any(_hf_config.sliding_windows(config, switched=True)):
        raise UserError("Qwen2 checkpoints with sliding-window layers (use_sliding_window: true) are not supported")
    if _hf_config.llama3_rope_scaling(config) is not None:
        raise UserError("Qwen2 checkpoints with llama3 rope scaling are not supported")
    return qwen2_5(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
