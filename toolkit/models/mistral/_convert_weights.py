"""Mistral checkpoints: Hugging Face's ``MistralForCausalLM`` names are Llama's, so the key mapping is Llama's
prefix; the config is Mistral's."""

from typing import Any

from toolkit.models.llama3._convert_weights import hf_key_to_tune, tune_key_to_hf
from toolkit.modules import TransformerDecoder

__all__ = ["hf_config", "hf_key_to_tune", "tune_key_to_hf"]


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``MistralForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    vocab_size, embed_dim = model.embed_tokens.weight.shape
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": vocab_size,
        "hidden_size": embed_dim,
        "intermediate_size": model.layers[0].mlp.gate_proj.weight.shape[0],
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "head_dim": attn.head_dim,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm.eps,
        "rope_theta": attn.pos_embeddings.base,
        "sliding_window": attn.sliding_window,
        "tie_word_embeddings": model.tie_word_embeddings,
        "hidden_act": "silu",
        "torch_dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
    }
