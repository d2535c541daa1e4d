"""Public Gemma 2 sizes (numbers from each release's config.json) and any size read from a Hugging Face
``config.json``."""

from functools import partial
from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.gemma2._component_builders import gemma2
from toolkit.modules.gemma2 import SoftcappedTransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("gemma2",)

_gemma2 = partial(gemma2, vocab_size=256_000)


def gemma2_2b(*, max_seq_len: int = 8192, linear: LinearFactory = plain_linear) -> SoftcappedTransformerDecoder:
    """Gemma 2 2B."""
    return _gemma2(
        num_layers=26, num_heads=8, num_kv_heads=4, head_dim=256, embed_dim=2304, intermediate_dim=9216,
        max_seq_len=max_seq_len, query_pre_attn_scalar=256, linear=linear,
    )


def gemma2_9b(*, max_seq_len: int = 8192, linear: LinearFactory = plain_linear) -> SoftcappedTransformerDecoder:
    """Gemma 2 9B."""
    return _gemma2(
        num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, embed_dim=3584, intermediate_dim=14_336,
        max_seq_len=max_seq_len, query_pre_attn_scalar=256, linear=linear,
    )


def gemma2_27b(*, max_seq_len: int = 8192, linear: LinearFactory = plain_linear) -> SoftcappedTransformerDecoder:
    """Gemma 2 27B (queries scaled by ``embed_dim / num_heads = 144`` rather than head_dim)."""
    return _gemma2(
        num_layers=46, num_heads=32, num_kv_heads=16, head_dim=128, embed_dim=4608, intermediate_dim=36_864,
        max_seq_len=max_seq_len, query_pre_attn_scalar=144, linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> SoftcappedTransformerDecoder:
    """A Gemma 2 with the dimensions of a Hugging Face ``Gemma2ForCausalLM`` ``config.json`` (as a dict).

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: a layer pattern other than Gemma 2's local/global alternation, an untied output, no final
            soft-capping, or an activation other than tanh-approximated GELU.
    """
    # A field the file leaves out takes transformers' Gemma2Config default (4096, 50, 30, 256, 256), as there.
    _hf_config.check_activation(config, key="hidden_activation", supported=("gelu_pytorch_tanh",))
    num_layers = config["num_hidden_layers"]
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    windows = _hf_config.sliding_windows(config, default_window=4096, default_layer_types=alternating)
    window = windows[0]
    if windows != [window if i % 2 == 0 else None for i in range(num_layers)]:
        raise UserError("Gemma 2 checkpoints must alternate sliding-window and full-attention layers, starting local")
    if config.get("tie_word_embeddings") is False:
        raise UserError("Gemma 2 checkpoints with an untied output projection are not supported")
    if _hf_config.llama3_rope_scaling(config) is not None:
        raise UserError("Gemma 2 checkpoints with llama3 rope scaling are not supported")
    final_logit_softcap = config.get("final_logit_softcapping", 30.0)
    if final_logit_softcap is None:
        raise UserError("Gemma 2 checkpoints without final_logit_softcapping are not supported")
    return gemma2(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=num_layers,
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        head_dim=_hf_config.head_dim(config, default=256),
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or config["max_position_embeddings"],
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        sliding_window=window,
        attn_logit_softcap=config.get("attn_logit_softcapping", 50.0),
        final_logit_softcap=final_logit_softcap,
    )
