"""The public Phi-4 size (numbers from ``microsoft/phi-4``'s config.json) and any Phi-3-architecture size read from a
Hugging Face ``config.json``."""

from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.phi3._component_builders import phi3
from toolkit.modules import TransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("phi3",)


def phi4_14b(*, max_seq_len: int = 16_384, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Phi-4 (14B)."""
    return phi3(
        vocab_size=100_352, num_layers=40, num_heads=40, num_kv_heads=10, head_dim=128, embed_dim=5120,
        intermediate_dim=17_920, max_seq_len=max_seq_len, norm_eps=1e-5, rope_base=250_000.0, linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Phi-3-architecture decoder with the dimensions of a Hugging Face ``Phi3ForCausalLM`` ``config.json``.

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: a feature the builder does not compute, named with its value: partial rotary embeddings
            (``partial_rotary_factor`` below 1: Phi-4-mini), rotary scaling (``longrope``: Phi-3 128k, Phi-4-mini),
            a sliding window (Phi-3-mini 4k), attention biases or an activation other than SiLU.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if config.get("attention_bias"):
        raise UserError("Phi-3 checkpoints with attention_bias are not supported")
    rope = _hf_config.rope_parameters(config)
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UserError(f"partial_rotary_factor {partial} is not supported (only 1.0: rotary on every feature)")
    if _hf_config.rope_type(config) != "default":
        raise UserError(f"rope_scaling type {_hf_config.rope_type(config)!r} is not supported for phi3 (only plain "
                        "rotary)")
    if config.get("sliding_window") is not None:
        raise UserError(f"sliding_window {config['sliding_window']} is not supported for phi3 (only null)")
    return phi3(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=_hf_config.head_dim(config),
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
