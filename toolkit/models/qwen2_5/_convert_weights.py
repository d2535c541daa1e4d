"""Qwen2.5 checkpoints: Hugging Face's ``Qwen2ForCausalLM`` names are Llama's (biases included), so the key
mapping is Llama's prefix; the config is Qwen2's."""

from typing import Any

from toolkit.models import _hf_config
from toolkit.models.llama3._convert_weights import hf_key_to_tune, tune_key_to_hf
from toolkit.modules import TransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "tune_key_to_hf"]


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Qwen2ForCausalLM`` with the architecture of ``model``."""
    num_layers = len(model.layers)
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **_hf_config.decoder_fields(model),
        "rope_scaling": None,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_layers,
    }
