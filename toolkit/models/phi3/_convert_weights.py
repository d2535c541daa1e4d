"""Phi-3 checkpoints: Hugging Face's ``Phi3ForCausalLM`` names are Llama's, except that each layer stores its query,
key and value projections as one ``self_attn.qkv_proj.weight`` (``[(n_h + 2 * n_kv) * h_d, dim]``: q rows, then k,
then v) and its gate and up projections as one ``mlp.gate_up_proj.weight`` (``[2 * hidden, dim]``: gate, then up).
Each fused tensor is the parts of our separate projections (``toolkit.models._expert_keys.Part`` row blocks): the
checkpointer splits it on load and joins our tensors back, in the same order, on export."""

import math
import re
from typing import Any

from toolkit.models import _hf_config
from toolkit.models._expert_keys import Part
from toolkit.models.llama3._convert_weights import hf_key_to_tune as llama_hf_key_to_tune
from toolkit.models.llama3._convert_weights import tune_key_to_hf as llama_tune_key_to_hf
from toolkit.modules import LongRopeRotaryEmbeddings, RotaryPositionalEmbeddings, TransformerDecoder

__all__ = ["FUSED", "hf_config", "hf_key_to_parts", "hf_key_to_tune", "tune_key_to_hf"]

FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}
"""Each fused Hugging Face projection of a layer (by its name there) and our projections its rows are, in order."""

_IN_FUSED = {ours: (fused, i) for fused, projections in FUSED.items() for i, ours in enumerate(projections)}
_FUSED_KEY = re.compile(r"model\.layers\.(\d+)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")
_OUR_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight")


def hf_key_to_tune(key: str) -> str:
    """A tensor HF stores whole: ``model.layers.0.self_attn.o_proj.weight`` -> ``layers.0.self_attn.o_proj.weight``
    (the fused ones are :func:`hf_key_to_parts`).

    Raises:
        KeyError: not a name of this family.
    """
    if _FUSED_KEY.fullmatch(key):
        raise KeyError(key)
    return llama_hf_key_to_tune(key)


def hf_key_to_parts(key: str) -> list[Part] | None:
    """Our projections that a fused HF tensor holds, as row blocks in order; ``None`` for any other tensor."""
    match = _FUSED_KEY.fullmatch(key)
    if match is None:
        return None
    layer, fused = match.groups()
    block = fused.partition(".")[0]
    projections = FUSED[fused]
    return [
        Part(f"layers.{layer}.{block}.{name}.weight", rows=(i, len(projections))) for i, name in enumerate(projections)
    ]


def tune_key_to_hf(key: str) -> str:
    """The HF tensor our ``key`` is written in: ``layers.0.self_attn.k_proj.weight`` ->
    ``model.layers.0.self_attn.qkv_proj.weight`` (several of ours share a fused one), else Llama's name."""
    match = _OUR_KEY.fullmatch(key)
    if match is not None and match.group(2) in _IN_FUSED:
        return f"model.layers.{match.group(1)}.{_IN_FUSED[match.group(2)][0]}.weight"
    return llama_tune_key_to_hf(key)


def hf_config(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face ``Phi3ForCausalLM`` with the architecture of ``model``."""
    attn = model.layers[0].self_attn
    rope = attn.pos_embeddings
    vocab_size = model.embed_tokens.weight.shape[0]
    # transformers' Phi3Config defaults pad_token_id to 32000 (Phi-3's), the padding row of its embedding, which it
    # refuses to build with a smaller vocabulary; such a model gets none (at 32000 or more the source's id stays).
    small = {"pad_token_id": None} if vocab_size <= 32_000 else {}
    return {
        **small,
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        **_hf_config.decoder_fields(model),
        "head_dim": attn.head_dim,
        **_rope_fields(rope, max_position_embeddings=model.max_seq_len),
        "partial_rotary_factor": _partial_rotary_factor(rope.rotary_dim, rope.head_dim),
        "sliding_window": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
    }


def _rope_fields(rope: RotaryPositionalEmbeddings, *, max_position_embeddings: int) -> dict[str, Any]:
    # LongRoPE's factors, and the original context at the top level, where Phi-3's files keep it.
    if not isinstance(rope, LongRopeRotaryEmbeddings):
        return {"rope_scaling": None}
    return {
        "rope_scaling": _hf_config.longrope_fields(rope.scaling, max_position_embeddings=max_position_embeddings),
        "original_max_position_embeddings": rope.scaling.original_max_position_embeddings,
    }


def _partial_rotary_factor(rotary_dim: int, head_dim: int) -> float:
    # The share transformers turns back into rotary_dim with int(head_dim * share): the quotient, or the next float
    # above it where rounding put it just below (44 features, 30 rotated).
    share = rotary_dim / head_dim
    return share if int(head_dim * share) == rotary_dim else math.nextafter(share, 1.0)
