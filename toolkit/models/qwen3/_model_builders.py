"""Public Qwen3 dense sizes (numbers from each release's config.json) and any size read from a Hugging Face
``config.json``."""

from functools import partial
from typing import Annotated, Any

from toolkit.config import Float
from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.qwen3._component_builders import qwen3
from toolkit.modules import TransformerDecoder, YarnRopeScaling

HF_MODEL_TYPES: tuple[str, ...] = ("qwen3",)

# Every public dense size shares the vocabulary and head_dim; only 0.6B, 1.7B and 4B tie the output.
_qwen3 = partial(qwen3, vocab_size=151_936, head_dim=128, num_kv_heads=8)

# The context every public dense size was trained at; YaRN stretches it (the model cards' setting for 131,072
# tokens is a factor of 4).
ORIGINAL_CONTEXT = 32_768
YarnFactor = Annotated[float | None, Float(gt=1, null=True)]


def _yarn(factor: float | None) -> YarnRopeScaling | None:
    if factor is None:
        return None
    return YarnRopeScaling(factor=factor, original_max_position_embeddings=ORIGINAL_CONTEXT)


def qwen3_0_6b(
    *, max_seq_len: int = 40_960, yarn_factor: YarnFactor = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """Qwen3 0.6B; ``yarn_factor`` stretches its 32,768-token context with YaRN (4 for 131,072)."""
    return _qwen3(
        num_layers=28, num_heads=16, embed_dim=1024, intermediate_dim=3072, max_seq_len=max_seq_len,
        tie_word_embeddings=True, rope_scaling=_yarn(yarn_factor), linear=linear,
    )


def qwen3_1_7b(
    *, max_seq_len: int = 40_960, yarn_factor: YarnFactor = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """Qwen3 1.7B; ``yarn_factor`` stretches its 32,768-token context with YaRN (4 for 131,072)."""
    return _qwen3(
        num_layers=28, num_heads=16, embed_dim=2048, intermediate_dim=6144, max_seq_len=max_seq_len,
        tie_word_embeddings=True, rope_scaling=_yarn(yarn_factor), linear=linear,
    )


def qwen3_4b(
    *, max_seq_len: int = 40_960, yarn_factor: YarnFactor = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """Qwen3 4B; ``yarn_factor`` stretches its 32,768-token context with YaRN (4 for 131,072)."""
    return _qwen3(
        num_layers=36, num_heads=32, embed_dim=2560, intermediate_dim=9728, max_seq_len=max_seq_len,
        tie_word_embeddings=True, rope_scaling=_yarn(yarn_factor), linear=linear,
    )


def qwen3_8b(
    *, max_seq_len: int = 40_960, yarn_factor: YarnFactor = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """Qwen3 8B; ``yarn_factor`` stretches its 32,768-token context with YaRN (4 for 131,072)."""
    return _qwen3(
        num_layers=36, num_heads=32, embed_dim=4096, intermediate_dim=12_288, max_seq_len=max_seq_len,
        rope_scaling=_yarn(yarn_factor), linear=linear,
    )


def qwen3_14b(
    *, max_seq_len: int = 40_960, yarn_factor: YarnFactor = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """Qwen3 14B; ``yarn_factor`` stretches its 32,768-token context with YaRN (4 for 131,072)."""
    return _qwen3(
        num_layers=40, num_heads=40, embed_dim=5120, intermediate_dim=17_408, max_seq_len=max_seq_len,
        rope_scaling=_yarn(yarn_factor), linear=linear,
    )


def qwen3_32b(
    *, max_seq_len: int = 40_960, yarn_factor: YarnFactor = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """Qwen3 32B; ``yarn_factor`` stretches its 32,768-token context with YaRN (4 for 131,072)."""
    return _qwen3(
        num_layers=64, num_heads=64, embed_dim=5120, intermediate_dim=25_600, max_seq_len=max_seq_len,
        rope_scaling=_yarn(yarn_factor), linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Qwen3 with the dimensions of a Hugging Face ``Qwen3ForCausalLM`` ``config.json`` (as a dict).

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: attention biases, sliding-window layers, rotary scaling other than YaRN or an activation other
            than SiLU, which no released Qwen3 uses.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if config.get("attention_bias"):
        raise UserError("Qwen3 checkpoints with attention_bias are not supported")
    if any(_hf_config.sliding_windows(config, switched=True)):
        raise UserError("Qwen3 checkpoints with sliding-window layers (use_sliding_window: true) are not supported")
    return qwen3(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=_hf_config.head_dim(config, default=128),
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        rope_scaling=_hf_config.yarn_rope_scaling(config),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
