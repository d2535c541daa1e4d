"""Qwen3-MoE checkpoints: Hugging Face's ``Qwen3MoeForCausalLM`` names are Qwen3's, with the router at
``mlp.gate.weight`` (ours too) and one tensor per expert (``mlp.experts.{e}.gate_proj.weight``...), which are slices
of our stacked experts (see ``toolkit.models._expert_keys``); the config is Qwen3-MoE's."""

from typing import Any

from toolkit.models import _hf_config
from toolkit.models._expert_keys import ExpertKeys
from toolkit.modules import TransformerDecoder
from toolkit.modules.moe import MoEFeedForward

__all__ = ["hf_config", "hf_key_to_parts", "hf_key_to_tune", "tune_key_to_hf", "tune_key_to_hf_slices"]

_KEYS = ExpertKeys(block="mlp", projections={"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"})
hf_key_to_tune = _KEYS.hf_key_to_tune
tune_key_to_hf = _KEYS.tune_key_to_hf
hf_key_to_parts = _KEYS.hf_key_to_parts
tune_key_to_hf_slices = _KEYS.tune_key_to_hf_slices


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Qwen3MoeForCausalLM`` with the architecture of ``model``.

    The dense layers are listed in ``mlp_only_layers`` (with ``decoder_sparse_step`` 1), whatever rule built them.
    The expert count is written in both spellings transformers has read (see ``_hf_config.num_experts``).
    """
    blocks = _hf_config.moe_blocks(model)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **_hf_config.decoder_fields(model),
        **_hf_config.moe_fields(model),
        "head_dim": model.layers[0].self_attn.head_dim,
        "rope_scaling": _hf_config.yarn_rope_fields(model.layers[0].self_attn.pos_embeddings.scaling),
        "attention_bias": False,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "num_experts": blocks[0].num_experts,
        "num_local_experts": blocks[0].num_experts,
        "moe_intermediate_size": blocks[0].experts.down_proj.shape[-1],
        "norm_topk_prob": blocks[0].gate.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, layer in enumerate(model.layers) if not isinstance(layer.mlp, MoEFeedForward)],
    }
