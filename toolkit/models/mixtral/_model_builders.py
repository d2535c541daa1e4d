"""Public Mixtral sizes (numbers from each release's config.json) and any size read from a Hugging Face
``config.json``."""

from functools import partial
from typing import Annotated, Any

from toolkit.config import Float
from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.mixtral._component_builders import mixtral
from toolkit.modules import TransformerDecoder

HF_MODEL_TYPES: tuple[str, ...] = ("mixtral",)

# Both releases: 8 experts, 2 per token; 8 key/value heads of 128 features; full attention.
_mixtral = partial(mixtral, num_experts=8, num_experts_per_tok=2, num_kv_heads=8, head_dim=128)


def mixtral_8x7b(
    *,
    max_seq_len: int = 32_768,
    router_aux_loss_coef: Annotated[float, Float(ge=0)] = 0.02,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Mixtral 8x7B v0.1 (46.7B parameters, 12.9B active per token)."""
    return _mixtral(
        vocab_size=32_000, num_layers=32, num_heads=32, embed_dim=4096, intermediate_dim=14_336,
        max_seq_len=max_seq_len, router_aux_loss_coef=router_aux_loss_coef, linear=linear,
    )


def mixtral_8x22b(
    *,
    max_seq_len: int = 65_536,
    router_aux_loss_coef: Annotated[float, Float(ge=0)] = 0.001,
    linear: LinearFactory = plain_linear,
) -> TransformerDecoder:
    """Mixtral 8x22B v0.1 (the 32,768-token vocabulary; 140.6B parameters, 39B active per token)."""
    return _mixtral(
        vocab_size=32_768, num_layers=56, num_heads=48, embed_dim=6144, intermediate_dim=16_384,
        max_seq_len=max_seq_len, router_aux_loss_coef=router_aux_loss_coef, linear=linear,
    )


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Mixtral with the dimensions of a Hugging Face ``MixtralForCausalLM`` ``config.json`` (as a dict).

    The load-balancing loss weighs ``_hf_config.router_aux_loss_coef`` in the training loss.

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: router jitter noise, layers with different windows, rotary scaling, or an activation other than
            SiLU.
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if config.get("router_jitter_noise"):
        raise UserError(
            f"router_jitter_noise {config['router_jitter_noise']} is not supported (the routers take no noise in "
            "training here); set it to 0.0"
        )
    windows = set(_hf_config.sliding_windows(config))
    if len(windows) > 1:
        raise UserError("Mixtral checkpoints mixing sliding-window and full-attention layers are not supported")
    if _hf_config.llama3_rope_scaling(config) is not None:
        raise UserError("Mixtral checkpoints with llama3 rope scaling are not supported")
    return mixtral(
        **_hf_config.moe_decoder_arguments(config, max_seq_len=max_seq_len, norm_eps=1e-5, rope_theta_default=1e6),
        intermediate_dim=config["intermediate_size"],
        sliding_window=windows.pop(),
        linear=linear,
    )
