"""The public Phi-4 sizes (numbers from ``microsoft/phi-4``'s and ``microsoft/Phi-4-mini-instruct``'s config.json)
and any Phi-3-architecture size read from a Hugging Face ``config.json``."""

from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.phi3._component_builders import phi3
from toolkit.modules import LongRopeScaling, TransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("phi3",)

PHI4_MINI_LONG_FACTOR = (
    1.0, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23, 32.6,
    32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
)
"""Phi-4-mini's LongRoPE ``long_factor``, one per rotated feature pair (its ``short_factor`` is all ones)."""

# transformers' Phi3Config default for a file without original_max_position_embeddings (Phi-3's 4k context).
_ORIGINAL_MAX_POSITION_EMBEDDINGS = 4096


def phi4_14b(*, max_seq_len: int = 16_384, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Phi-4 (14B)."""
    return phi3(
        vocab_size=100_352, num_layers=40, num_heads=40, num_kv_heads=10, head_dim=128, embed_dim=5120,
        intermediate_dim=17_920, max_seq_len=max_seq_len, norm_eps=1e-5, rope_base=250_000.0, linear=linear,
    )


def phi4_mini(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Phi-4-mini (3.8B; Phi-4-mini-instruct and Phi-4-mini-reasoning): rotary on 96 of each head's 128 features,
    LongRoPE from 4,096 to 131,072 tokens, tied embeddings."""
    rope_scaling = LongRopeScaling(
        short_factor=(1.0,) * 48, long_factor=PHI4_MINI_LONG_FACTOR, original_max_position_embeddings=4096,
        factor=131_072 / 4096,
    )
    return phi3(
        vocab_size=200_064, num_layers=32, num_heads=24, num_kv_heads=8, head_dim=128, embed_dim=3072,
        intermediate_dim=8192, max_seq_len=max_seq_len, norm_eps=1e-5, rope_base=10_000.0, partial_rotary_factor=0.75,
        rope_scaling=rope_scaling, tie_word_embeddings=True, linear=linear,
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
        UserError: a feature the builder does not compute, named with its value: rotary scaling other than
            ``longrope`` (``su``, its first name, is read as it), a sliding window shorter than
            ``max_position_embeddings`` (Phi-3-mini 4k), attention biases or an activation other than SiLU; or a ``partial_rotary_factor`` or
            LongRoPE factor lists that do not fit the head's features.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if config.get("attention_bias"):
        raise UserError("Phi-3 checkpoints with attention_bias are not supported")
    rope = _hf_config.rope_parameters(config)
    # Phi-3 128k, Phi-3.5-mini and Phi-4-mini set a window (262,144) longer than their context: no token is out of
    # it, as without one. A shorter one is refused even where this model's max_seq_len would fit in it: the export
    # (no window) would be another model past it.
    window, context = config.get("sliding_window"), config["max_position_embeddings"]
    if window is not None and window < context:
        raise UserError(f"sliding_window {window} is not supported for phi3 (only null or at least "
                        f"max_position_embeddings, {context})")
    head_dim = _hf_config.head_dim(config)
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rope_type = _hf_config.rope_type(config)
    if rope_type not in ("default", "longrope", "su"):
        raise UserError(f"rope_scaling type {rope_type!r} is not supported for phi3 (only 'longrope' and plain "
                        "rotary)")
    rotary_dim = int(head_dim * partial)  # as transformers counts the rotated features
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UserError(f"partial_rotary_factor {partial} rotates {rotary_dim} of each head's {head_dim} features; an "
                        "even number, at least 2, is needed")
    rope_scaling = None if rope_type == "default" else _hf_config.longrope_scaling(
        config, rotary_dim=rotary_dim, default_original=_ORIGINAL_MAX_POSITION_EMBEDDINGS
    )
    return phi3(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=head_dim,
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or context,
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        partial_rotary_factor=partial,
        rope_scaling=rope_scaling,
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
