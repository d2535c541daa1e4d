"""Qwen3 checkpoints: Hugging Face's ``Qwen3ForCausalLM`` names are Llama's plus ``self_attn.q_norm`` and
``self_attn.k_norm``, which are ours too, so the key mapping is Llama's prefix; the config is Qwen3's."""

from typing import Any

from toolkit.models.llama3._convert_weights import hf_key_to_tune, tune_key_to_hf
from toolkit.modules import TransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "tune_key_to_hf"]


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Qwen3ForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    vocab_size, embed_dim = model.embed_tokens.weight.shape
    num_layers = len(model.layers)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": embed_dim,
        "intermediate_size": model.layers[0].mlp.gate_proj.weight.shape[0],
        "num_hidden_layers": num_layers,
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm.eps,
        "rope_theta": attn.pos_embeddings.base,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": model.tie_word_embeddings,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * num_layers,
        "torch_dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
    }
