"""Public Qwen3-MoE sizes (numbers from each release's config.json) and any size read from a Hugging Face
``config.json``."""

from functools import partial
from typing import Annotated, Any

from toolkit.config import Float
from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.qwen3_moe._component_builders import qwen3_moe
from toolkit.modules import TransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("qwen3_moe",)

# Both releases: 128 experts of which 8 per token, renormalized, on every layer; 4 key/value heads of 128 features.
_qwen3_moe = partial(
    qwen3_moe, vocab_size=151_936, head_dim=128, num_kv_heads=4, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True,
)


def qwen3_moe_30b_a3b(
    *,
    max_seq_len: int = 40_960,
    router_aux_loss_coef: Annotated[float, Float(ge=0)] = 0.001,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Qwen3-30B-A3B (30.5B parameters, 3.3B active per token)."""
    return _qwen3_moe(
        num_layers=48, num_heads=32, embed_dim=2048, moe_intermediate_dim=768, max_seq_len=max_seq_len,
        router_aux_loss_coef=router_aux_loss_coef, linear=linear,
    )


def qwen3_moe_235b_a22b(
    *,
    max_seq_len: int = 40_960,
    router_aux_loss_coef: Annotated[float, Float(ge=0)] = 0.001,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Qwen3-235B-A22B (235B parameters, 22B active per token)."""
    return _qwen3_moe(
        num_layers=94, num_heads=64, embed_dim=4096, moe_intermediate_dim=1536, max_seq_len=max_seq_len,
        router_aux_loss_coef=router_aux_loss_coef, linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Qwen3-MoE with the dimensions of a Hugging Face ``Qwen3MoeForCausalLM`` ``config.json`` (as a dict).

    The load-balancing loss weighs ``_hf_config.router_aux_loss_coef`` in the training loss.

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: attention biases, sliding-window layers, rotary scaling other than YaRN or an activation other
            than SiLU, which no released Qwen3-MoE uses.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if config.get("attention_bias"):
        raise UserError("Qwen3-MoE checkpoints with attention_bias are not supported")
    if any(_hf_config.sliding_windows(config, switched=True)):
        raise UserError("Qwen3-MoE checkpoints with sliding-window layers (use_sliding_window: true) are not supported")
    return qwen3_moe(
        rope_scaling=_hf_config.yarn_rope_scaling(config),
        **_hf_config.moe_decoder_arguments(config, max_seq_len=max_seq_len, norm_eps=1e-6, rope_theta_default=10_000.0),
        moe_intermediate_dim=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False),
        intermediate_dim=config.get("intermediate_size"),
        mlp_only_layers=config.get("mlp_only_layers") or (),
        decoder_sparse_step=config.get("decoder_sparse_step", 1),
        linear=linear,
    )
