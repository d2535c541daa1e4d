"""Weight names and configs between our Llama modules and the Hugging Face and Meta checkpoint layouts.

Our module names follow Hugging Face's Llama (``self_attn.q_proj``, ``mlp.gate_proj``...), so the HF mapping is
a prefix; Meta's layout also needs the rotary permutation of q/k rows (Meta pairs adjacent features, HF and we
pair the two halves of each head).
"""

import re

import torch

from toolkit.models import _hf_config
from toolkit.modules import Llama3RopeScaling, TransformerDecoder

_META_TO_TUNE = {
    "tok_embeddings.weight": "embed_tokens.weight",
    "norm.weight": "norm.weight",
    "output.weight": "output.weight",
    "layers.{}.attention.wq.weight": "layers.{}.self_attn.q_proj.weight",
    "layers.{}.attention.wk.weight": "layers.{}.self_attn.k_proj.weight",
    "layers.{}.attention.wv.weight": "layers.{}.self_attn.v_proj.weight",
    "layers.{}.attention.wo.weight": "layers.{}.self_attn.o_proj.weight",
    "layers.{}.feed_forward.w1.weight": "layers.{}.mlp.gate_proj.weight",
    "layers.{}.feed_forward.w2.weight": "layers.{}.mlp.down_proj.weight",
    "layers.{}.feed_forward.w3.weight": "layers.{}.mlp.up_proj.weight",
    "layers.{}.attention_norm.weight": "layers.{}.input_layernorm.weight",
    "layers.{}.ffn_norm.weight": "layers.{}.post_attention_layernorm.weight",
}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def hf_key_to_tune(key: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``layers.0.self_attn.q_proj.weight``."""
    if key == "lm_head.weight":
        return "output.weight"
    if key.startswith("model."):
        return key[len("model."):]
    raise KeyError(key)


def tune_key_to_hf(key: str) -> str:
    """The inverse of :func:`hf_key_to_tune`."""
    return "lm_head.weight" if key == "output.weight" else "model." + key


def hf_to_tune(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a Hugging Face Llama state dict to ours (rotary buffers HF may carry are dropped)."""
    return {hf_key_to_tune(k): v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}


def tune_to_hf(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename our state dict to Hugging Face's Llama names."""
    return {tune_key_to_hf(k): v for k, v in state_dict.items()}


def _meta_rows_to_halves(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Meta stores each head's rotary pairs interleaved (x0, x1), (x2, x3)...; we want (x0, x2, ...), (x1, x3, ...).
    out_dim, in_dim = w.shape
    head_dim = out_dim // num_heads
    return w.view(num_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _halves_to_meta_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    out_dim, in_dim = w.shape
    head_dim = out_dim // num_heads
    return w.view(num_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def meta_to_tune(state_dict: dict[str, torch.Tensor], *, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Convert a Meta ``consolidated.00.pth`` Llama state dict to ours."""
    out = {}
    for key, value in state_dict.items():
        if key == "rope.freqs":
            continue
        match = _LAYER_INDEX.search(key)
        pattern = _LAYER_INDEX.sub(".{}.", key, count=1) if match else key
        if pattern not in _META_TO_TUNE:
            raise KeyError(key)
        new_key = _META_TO_TUNE[pattern].format(match.group(1)) if match else _META_TO_TUNE[pattern]
        if new_key.endswith("q_proj.weight"):
            value = _meta_rows_to_halves(value, num_heads)
        elif new_key.endswith("k_proj.weight"):
            value = _meta_rows_to_halves(value, num_kv_heads)
        out[new_key] = value
    return out


def tune_to_meta(state_dict: dict[str, torch.Tensor], *, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """Convert our Llama state dict to Meta's layout (the inverse of :func:`meta_to_tune`)."""
    inverse = {v: k for k, v in _META_TO_TUNE.items()}
    out = {}
    for key, value in state_dict.items():
        match = _LAYER_INDEX.search(key)
        pattern = _LAYER_INDEX.sub(".{}.", key, count=1) if match else key
        new_key = inverse[pattern].format(match.group(1)) if match else inverse[pattern]
        if key.endswith("q_proj.weight"):
            value = _halves_to_meta_rows(value, num_heads)
        elif key.endswith("k_proj.weight"):
            value = _halves_to_meta_rows(value, num_kv_heads)
        out[new_key] = value
    return out


def hf_config(model: TransformerDecoder) -> dict:
    """The ``config.json`` of a Hugging Face ``LlamaForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    rope = attn.pos_embeddings
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_hf_config.decoder_fields(model),
        "head_dim": attn.head_dim,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    }
    scaling: Llama3RopeScaling | None = rope.scaling
    if scaling is not None:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
        }
    return config
