"""Gemma 2 checkpoints: Hugging Face's ``Gemma2ForCausalLM`` names are ours under ``model.`` (the four norms of a
layer included), and the output is always tied, so the key mapping is Llama's prefix; the config is Gemma 2's."""

from typing import Any

from toolkit.models import _hf_config
from toolkit.models.llama3._convert_weights import hf_key_to_tune, tune_key_to_hf
from toolkit.modules.gemma2 import SoftcappedTransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "tune_key_to_hf"]


def hf_config(model: SoftcappedTransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Gemma2ForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    return {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        **_hf_config.decoder_fields(model),
        "head_dim": attn.head_dim,
        # The builder stores the scale; the config wants the (integer) scalar whose inverse square root it is.
        "query_pre_attn_scalar": round(attn.softmax_scale**-2),
        "attn_logit_softcapping": attn.logit_softcap,
        "final_logit_softcapping": model.final_logit_softcap,
        "sliding_window": next((w for w in windows if w is not None), None),
        "layer_types": ["sliding_attention" if w is not None else "full_attention" for w in windows],
        "hidden_activation": "gelu_pytorch_tanh",
    }
