"""Gemma 3 checkpoints. ``Gemma3ForCausalLM`` (the 1B, ``model_type: gemma3_text``) names our tensors under
``model.``, as Gemma 2 does. The larger releases are ``Gemma3ForConditionalGeneration`` (``model_type: gemma3``):
the same language model under ``language_model.model.`` (the files Google published, and transformers' saves) or
``model.language_model.`` (transformers 5's module names, which other tools save), beside a vision tower and a
projector that the text model does not use; those are skipped on load (:func:`skipped_hf_key`). Exports are always
the text-only layout, with a ``gemma3_text`` config, which ``Gemma3ForCausalLM`` loads."""

import re
from typing import Any

from toolkit.models import _hf_config
from toolkit.models.gemma3._component_builders import is_global_layer
from toolkit.models.llama3._convert_weights import hf_key_to_tune as llama_hf_key_to_tune
from toolkit.models.llama3._convert_weights import tune_key_to_hf
from toolkit.modules import LinearRopeScaling, TransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "skipped_hf_key", "tune_key_to_hf"]

# The language model's prefix in a Gemma3ForConditionalGeneration checkpoint, as published and as transformers 5
# names its modules; both stand for Gemma3ForCausalLM's ``model.``.
_MULTIMODAL_PREFIX = re.compile(r"^(?:language_model\.model\.|model\.language_model\.)")
_VISION = re.compile(r"^(?:model\.)?(vision_tower|multi_modal_projector)\.")


def hf_key_to_tune(key: str) -> str:
    """``model.layers.0.self_attn.q_norm.weight`` (or ``language_model.model.layers...``,
    ``model.language_model.layers...``) -> ``layers.0.self_attn.q_norm.weight``.

    Raises:
        KeyError: not a name of the language model.
    """
    if key == "language_model.lm_head.weight":
        return "output.weight"
    return llama_hf_key_to_tune(_MULTIMODAL_PREFIX.sub("model.", key))


def skipped_hf_key(key: str) -> str | None:
    """What a tensor of a multimodal checkpoint is when the text model does not use it (``vision_tower`` or
    ``multi_modal_projector``); ``None`` for every other tensor."""
    match = _VISION.match(key)
    return match.group(1) if match else None


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Gemma3ForCausalLM`` with the architecture of ``model``.

    The rotary settings are written in the spelling every transformers release with Gemma 3 reads: ``rope_theta``
    and ``rope_scaling`` for the global layers, ``rope_local_base_freq`` for the local ones. A model too shallow to
    have a global layer writes no global settings (transformers' defaults; no layer uses them).
    """
    attn = model.layers[0].self_attn  # a local layer (the builder puts at least one before each global one)
    first_global = next((i for i, layer in enumerate(model.layers) if layer.self_attn.sliding_window is None), None)
    pattern = first_global + 1 if first_global is not None else len(model.layers) + 1
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **_hf_config.decoder_fields(model),
        "head_dim": attn.head_dim,
        # The builder stores the scale; the config wants the (integer) scalar whose inverse square root it is.
        "query_pre_attn_scalar": round(attn.softmax_scale**-2),
        "attn_logit_softcapping": attn.logit_softcap,
        "final_logit_softcapping": getattr(model, "final_logit_softcap", None),
        "sliding_window": attn.sliding_window,
        "sliding_window_pattern": pattern,
        "layer_types": ["full_attention" if is_global_layer(i, pattern) else "sliding_attention"
                        for i in range(len(model.layers))],
        "rope_local_base_freq": attn.pos_embeddings.base,
        "rope_scaling": None,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    del config["rope_theta"]  # decoder_fields reads layer 0's, the local one
    if first_global is not None:
        rope = model.layers[first_global].self_attn.pos_embeddings
        config["rope_theta"] = rope.base
        if isinstance(rope.scaling, LinearRopeScaling):
            config["rope_scaling"] = {"rope_type": "linear", "factor": rope.scaling.factor}
    return config
