"""Qwen3 checkpoints: Hugging Face's ``Qwen3ForCausalLM`` names are Llama's plus ``self_attn.q_norm`` and
``self_attn.k_norm``, which are ours too, so the key mapping is Llama's prefix; the config is Qwen3's."""

from typing import Any

from toolkit.models import _hf_config
from toolkit.models.llama3._convert_weights import hf_key_to_tune, tune_key_to_hf
from toolkit.modules import TransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "tune_key_to_hf"]


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Qwen3ForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    num_layers = len(model.layers)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **_hf_config.decoder_fields(model),
        "head_dim": attn.head_dim,
        "rope_scaling": _hf_config.yarn_rope_fields(attn.pos_embeddings.scaling),
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_layers,
    }
