"""Public Mistral sizes (numbers from the v0.3 release's config.json) and any size read from a Hugging Face
``config.json``."""

from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.mistral._component_builders import mistral
from toolkit.modules import TransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("mistral",)


def mistral_7b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Mistral 7B v0.3 (the 32,768-token vocabulary; no sliding window)."""
    return mistral(
        vocab_size=32_768,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        embed_dim=4096,
        intermediate_dim=14_336,
        max_seq_len=max_seq_len,
        linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Mistral with the dimensions of a Hugging Face ``MistralForCausalLM`` ``config.json`` (as a dict).

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: layers with different windows, rotary scaling, or an activation other than SiLU.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    windows = set(_hf_config.sliding_windows(config, default_window=4096))
    if len(windows) > 1:
        raise UserError("Mistral checkpoints mixing sliding-window and full-attention layers are not supported")
    if _hf_config.llama3_rope_scaling(config) is not None:
        raise UserError("Mistral checkpoints with llama3 rope scaling are not supported")
    return mistral(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=_hf_config.head_dim(config),
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        sliding_window=windows.pop(),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
