"""Public Gemma 3 text sizes (numbers from each release's config.json: the 1B's own, the larger releases'
``text_config`` with transformers' defaults for the fields it leaves out) and any size read from a Hugging Face
``config.json``, text-only (``gemma3_text``) or multimodal (``gemma3``, whose language model is built)."""

from functools import partial
from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.gemma3._component_builders import gemma3, is_global_layer
from toolkit.modules import LinearRopeScaling, TransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("gemma3_text", "gemma3")

# transformers' Gemma3TextConfig defaults, which a file's (or a multimodal file's text_config's) fields override.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096, "sliding_window_pattern": 6,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
}

# From 4B up: one vocabulary (the 1B's plus image tokens), windows of 1024, and the global layers' rotary
# frequencies divided by 8 to reach 131,072 positions.
_gemma3_mm = partial(gemma3, vocab_size=262_208, sliding_window=1024, rope_scaling=LinearRopeScaling(factor=8.0))


def gemma3_1b(*, max_seq_len: int = 32_768, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Gemma 3 1B (text only; no rotary scaling)."""
    return gemma3(
        vocab_size=262_144, num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, embed_dim=1152,
        intermediate_dim=6912, max_seq_len=max_seq_len, query_pre_attn_scalar=256, sliding_window=512, linear=linear,
    )


def gemma3_4b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Gemma 3 4B's language model."""
    return _gemma3_mm(
        num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256, embed_dim=2560, intermediate_dim=10_240,
        max_seq_len=max_seq_len, query_pre_attn_scalar=256, linear=linear,
    )


def gemma3_12b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Gemma 3 12B's language model."""
    return _gemma3_mm(
        num_layers=48, num_heads=16, num_kv_heads=8, head_dim=256, embed_dim=3840, intermediate_dim=15_360,
        max_seq_len=max_seq_len, query_pre_attn_scalar=256, linear=linear,
    )


def gemma3_27b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Gemma 3 27B's language model (queries scaled by ``embed_dim / num_heads = 168`` rather than head_dim)."""
    return _gemma3_mm(
        num_layers=62, num_heads=32, num_kv_heads=16, head_dim=128, embed_dim=5376, intermediate_dim=21_504,
        max_seq_len=max_seq_len, query_pre_attn_scalar=168, linear=linear,
    )


def _rope_settings(text: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The global and the local layers' rotary settings: transformers 5 nests them per layer type in
    ``rope_parameters``; earlier files have ``rope_theta`` and ``rope_scaling`` (global) and
    ``rope_local_base_freq`` (local)."""
    nested = text.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        return nested.get("full_attention") or {}, nested.get("sliding_attention") or {}
    return _hf_config.rope_parameters(text), {"rope_theta": text["rope_local_base_freq"]}


def _rope_type(params: dict[str, Any]) -> str:
    return params.get("rope_type", params.get("type", "default"))


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Gemma 3 text decoder with the dimensions of a Hugging Face ``config.json`` (as a dict): a
    ``Gemma3ForCausalLM``'s, or a ``Gemma3ForConditionalGeneration``'s, whose ``text_config`` describes it.

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a multimodal config without ``text_config``.
        UserError: a feature the builder does not compute, named with its value: layer types that are not one
            global layer every ``k >= 2`` (Gemma 3's pattern), no sliding window, bidirectional attention
            (EmbeddingGemma), a rotary scaling other than linear (or any on the local layers), attention biases,
            an untied output, or an activation other than tanh-approximated GELU.
    """
    text = _TEXT_DEFAULTS | (config["text_config"] if config.get("model_type") == "gemma3" else config)
    _hf_config.check_activation(text, key="hidden_activation", supported=("gelu_pytorch_tanh",))
    for key in ("attention_bias", "use_bidirectional_attention"):
        if text.get(key):
            raise UserError(f"{key} {text[key]!r} is not supported for gemma3 (only false)")
    if text.get("tie_word_embeddings") is False:
        raise UserError("tie_word_embeddings false is not supported for gemma3 (the output is the embedding)")
    if text["sliding_window"] is None:
        raise UserError("sliding_window null is not supported for gemma3 (its local layers need a window)")
    num_layers = text["num_hidden_layers"]
    layer_types = text.get("layer_types") or [
        "full_attention" if is_global_layer(i, int(text["sliding_window_pattern"])) else "sliding_attention"
        for i in range(num_layers)
    ]
    pattern = layer_types.index("full_attention") + 1 if "full_attention" in layer_types else num_layers + 1
    if pattern < 2 or layer_types != ["full_attention" if is_global_layer(i, pattern) else "sliding_attention"
                                      for i in range(num_layers)]:
        raise UserError(f"layer_types {layer_types} are not supported for gemma3 (only one full_attention layer "
                        "every k >= 2 layers, the others sliding_attention)")
    global_rope, local_rope = _rope_settings(text)
    if _rope_type(local_rope) != "default":
        raise UserError(f"rope type {_rope_type(local_rope)!r} of the sliding_attention layers is not supported for "
                        "gemma3 (only plain rotary)")
    scaling = None
    if _rope_type(global_rope) == "linear":
        scaling = LinearRopeScaling(factor=float(global_rope["factor"]))
    elif _rope_type(global_rope) != "default":
        raise UserError(f"rope_scaling type {_rope_type(global_rope)!r} is not supported for gemma3 (only 'linear' "
                        "and plain rotary)")
    return gemma3(
        linear=linear,
        vocab_size=text["vocab_size"],
        num_layers=num_layers,
        num_heads=text["num_attention_heads"],
        num_kv_heads=text["num_key_value_heads"] or text["num_attention_heads"],
        head_dim=_hf_config.head_dim(text),
        embed_dim=text["hidden_size"],
        intermediate_dim=text["intermediate_size"],
        max_seq_len=max_seq_len or text["max_position_embeddings"],
        query_pre_attn_scalar=text["query_pre_attn_scalar"],
        sliding_window=int(text["sliding_window"]),
        sliding_window_pattern=pattern,
        norm_eps=text["rms_norm_eps"],
        rope_base=float(global_rope.get("rope_theta", _TEXT_DEFAULTS["rope_theta"])),
        rope_local_base=float(local_rope.get("rope_theta", _TEXT_DEFAULTS["rope_local_base_freq"])),
        rope_scaling=scaling,
        attn_logit_softcap=text["attn_logit_softcapping"],
        final_logit_softcap=text["final_logit_softcapping"],
    )
