"""Mistral checkpoints: Hugging Face's ``MistralForCausalLM`` names are Llama's, so the key mapping is Llama's
prefix; the config is Mistral's."""

from typing import Any

from toolkit.models import _hf_config
from toolkit.models.llama3._convert_weights import hf_key_to_tune, tune_key_to_hf
from toolkit.modules import TransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "tune_key_to_hf"]


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``MistralForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **_hf_config.decoder_fields(model),
        "head_dim": attn.head_dim,
        "sliding_window": attn.sliding_window,
        "hidden_act": "silu",
    }
