"""Mixtral checkpoints: Hugging Face's ``MixtralForCausalLM`` files name the MoE block ``block_sparse_moe`` (ours:
``mlp``) and store one tensor per expert, ``w1`` (gate), ``w3`` (up) and ``w2`` (down), which are slices of our
stacked experts (see ``toolkit.models._expert_keys``); the rest is Mistral's. The config is Mixtral's."""

from typing import Any

from toolkit.models import _hf_config
from toolkit.models._expert_keys import ExpertKeys
from toolkit.modules import TransformerDecoder

__all__ = ["hf_config", "hf_key_to_parts", "hf_key_to_tune", "tune_key_to_hf", "tune_key_to_hf_slices"]

_KEYS = ExpertKeys(block="block_sparse_moe", projections={"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
hf_key_to_tune = _KEYS.hf_key_to_tune
tune_key_to_hf = _KEYS.tune_key_to_hf
hf_key_to_parts = _KEYS.hf_key_to_parts
tune_key_to_hf_slices = _KEYS.tune_key_to_hf_slices


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``MixtralForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    block = _hf_config.moe_blocks(model)[0]
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        **_hf_config.decoder_fields(model),
        **_hf_config.moe_fields(model),
        "intermediate_size": block.experts.down_proj.shape[-1],
        "num_local_experts": block.num_experts,
        "router_jitter_noise": 0.0,
        "head_dim": attn.head_dim,
        "sliding_window": attn.sliding_window,
        "hidden_act": "silu",
    }
