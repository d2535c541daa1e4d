"""Architecture fields of a Hugging Face ``config.json``: read across the spellings transformers has used, and
the fields every decoder family writes."""

from typing import Any

from toolkit.errors import UserError
from toolkit.modules import Llama3RopeScaling, LongRopeScaling, TransformerDecoder, YarnRopeScaling
from toolkit.modules.moe import MoEFeedForward


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rotary settings: transformers 5 nests them in ``rope_parameters``, earlier releases wrote
    ``rope_theta`` and ``rope_scaling`` at the top level; both are merged here."""
    merged = dict(config.get("rope_scaling") or {})
    merged.update(config.get("rope_parameters") or {})
    if config.get("rope_theta") is not None:
        merged.setdefault("rope_theta", config["rope_theta"])
    return merged


def rope_theta(config: dict[str, Any], default: float) -> float:
    """The rotary base, or ``default`` (the architecture's) when the file leaves it out."""
    return float(rope_parameters(config).get("rope_theta", default))


def rope_type(config: dict[str, Any]) -> str:
    """The rotary scaling the config asks for (``rope_type``, ``type`` in older files), ``default`` for none."""
    params = rope_parameters(config)
    return params.get("rope_type", params.get("type", "default"))


def llama3_rope_scaling(config: dict[str, Any]) -> Llama3RopeScaling | None:
    """Llama 3.1's frequency scaling if the config asks for it, ``None`` for plain rotary embeddings.

    Raises:
        UserError: another scaling type (linear, dynamic, yarn...), which the families that call this do not
            implement.
    """
    params, rope_type_ = rope_parameters(config), rope_type(config)
    if rope_type_ == "default":
        return None
    if rope_type_ != "llama3":
        raise UserError(f"rope scaling type {rope_type_!r} is not supported (only 'llama3' and plain rotary)")
    return Llama3RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def yarn_rope_scaling(config: dict[str, Any]) -> YarnRopeScaling | None:
    """YaRN if the config asks for it (Qwen3's long-context setting), ``None`` for plain rotary embeddings.

    Raises:
        UserError: another scaling type, which the families that call this do not implement.
    """
    params, rope_type_ = rope_parameters(config), rope_type(config)
    if rope_type_ == "default":
        return None
    if rope_type_ != "yarn":
        raise UserError(f"rope scaling type {rope_type_!r} is not supported for this family (only 'yarn' and plain "
                        "rotary)")
    original = params.get("original_max_position_embeddings") or config["max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # as transformers reads it: the ratio of the extended context to the original one
        factor = config["max_position_embeddings"] / original
    optional = {key: params[key] for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                                              "truncate") if params.get(key) is not None}
    return YarnRopeScaling(factor=float(factor), original_max_position_embeddings=int(original), **optional)


def yarn_rope_fields(scaling: YarnRopeScaling | None) -> dict[str, Any] | None:
    """``rope_scaling`` as a ``config.json`` writes it, for an export (``None`` without scaling)."""
    if scaling is None:
        return None
    fields = {"rope_type": "yarn", "factor": scaling.factor,
              "original_max_position_embeddings": scaling.original_max_position_embeddings}
    for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
        value = getattr(scaling, key)
        if value is not None and value != YarnRopeScaling.__dataclass_fields__[key].default:
            fields[key] = value
    if not scaling.truncate:
        fields["truncate"] = False
    return fields


def longrope_scaling(config: dict[str, Any], *, rotary_dim: int, default_original: int) -> LongRopeScaling:
    """LongRoPE's settings as transformers reads them for Phi-3: ``short_factor`` and ``long_factor`` (one per
    rotated feature pair), ``original_max_position_embeddings`` from the top level first (transformers gives it
    priority), then ``rope_scaling``, else the architecture's ``default_original``; ``factor`` if given, else
    ``max_position_embeddings`` over the original length; ``attention_factor`` if given.

    Raises:
        UserError: a factor list missing, not numbers, or not of ``rotary_dim / 2`` entries.
    """
    params = rope_parameters(config)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or len(values) != rotary_dim // 2 or not all(
                isinstance(v, (int, float)) for v in values):
            raise UserError(f"rope_scaling {key}: {rotary_dim // 2} numbers expected (one per rotated feature pair), "
                            f"got {values!r}")
        factors[key] = tuple(float(v) for v in values)
    original = int(config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
                   or default_original)
    factor = params.get("factor") or config["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    return LongRopeScaling(**factors, original_max_position_embeddings=original, factor=float(factor),
                           attention_factor=None if attention_factor is None else float(attention_factor))


def longrope_fields(scaling: LongRopeScaling, *, max_position_embeddings: int) -> dict[str, Any]:
    """``rope_scaling`` as a Phi-3 ``config.json`` writes LongRoPE, for an export: ``factor`` only where
    ``max_position_embeddings`` over the original length would not give it back."""
    fields: dict[str, Any] = {"type": "longrope", "short_factor": list(scaling.short_factor),
                              "long_factor": list(scaling.long_factor)}
    if scaling.factor != max_position_embeddings / scaling.original_max_position_embeddings:
        fields["factor"] = scaling.factor
    if scaling.attention_factor is not None:
        fields["attention_factor"] = scaling.attention_factor
    return fields


SILU = ("silu", "swish")
"""The names ``transformers`` gives SiLU, the activation of the Llama, Mistral and Qwen feed-forwards."""


def check_activation(config: dict[str, Any], *, key: str = "hidden_act", supported: tuple[str, ...]) -> None:
    """Refuse a feed-forward activation the family's builder does not compute: the builders hard-code theirs
    (SiLU for Llama, Mistral and Qwen; tanh-approximated GELU for Gemma 2), so another one would load and silently
    give other logits than ``transformers``.

    Args:
        config: the parsed ``config.json``.
        key: the field ``transformers`` reads for this architecture (Gemma 2: ``hidden_activation``).
        supported: the names of the builder's activation; a file without the field gets the first.

    Raises:
        UserError: an activation not in ``supported``.
    """
    activation = config.get(key) or supported[0]
    if activation not in supported:
        raise UserError(f"{key} {activation!r} is not supported; this architecture computes {supported[0]!r}")


def head_dim(config: dict[str, Any], default: int | None = None) -> int:
    """``head_dim`` when the file gives one (Qwen3, Gemma 2, Mistral), else the architecture's ``default`` where
    ``transformers`` has a fixed one (Qwen3: 128, Gemma 2: 256), else ``hidden_size // num_attention_heads``."""
    return int(config.get("head_dim") or default or config["hidden_size"] // config["num_attention_heads"])


def sliding_windows(
    config: dict[str, Any],
    *,
    default_window: int | None = None,
    switched: bool = False,
    default_layer_types: list[str] | None = None,
) -> list[int | None]:
    """Per layer, the sliding attention window, or ``None`` for full attention, read as ``transformers`` reads it.

    transformers 5 lists ``layer_types``; older files only give ``sliding_window``, and the architecture implies
    which layers slide: all of them (Mistral), or ``default_layer_types`` (Gemma 2 alternates).

    Args:
        config: the parsed ``config.json``.
        default_window: the window of a file without ``sliding_window`` (``transformers``' default: 4096 for
            Mistral and Gemma 2); an explicit ``null`` means none.
        switched: the window applies only with ``use_sliding_window: true`` (Qwen; off when the file leaves it
            out, and in every released model).
        default_layer_types: which layers slide when the file has no ``layer_types``; all by default.
    """
    num_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window", default_window)
    if switched and not config.get("use_sliding_window", False):
        window = None
    if window is None:
        return [None] * num_layers
    layer_types = config.get("layer_types") or default_layer_types or ["sliding_attention"] * num_layers
    return [int(window) if t == "sliding_attention" else None for t in layer_types]


def num_experts(config: dict[str, Any]) -> int:
    """The experts of each mixture-of-experts layer: ``num_experts`` or ``num_local_experts``, two spellings
    transformers 5 reads as one (it writes the second; Qwen3-MoE's releases have the first).

    Raises:
        KeyError: neither is there.
    """
    return int(config.get("num_experts") or config["num_local_experts"])


def moe_decoder_arguments(
    config: dict[str, Any], *, max_seq_len: int | None, norm_eps: float, rope_theta_default: float
) -> dict[str, Any]:
    """The builder arguments of the Mixtral and Qwen3-MoE families that their ``config.json`` spell alike: the
    attention's and the width's, the experts' count, top-k and loss weight, and the context length (``max_seq_len``,
    else the file's ``max_position_embeddings``). ``norm_eps`` and ``rope_theta_default`` are transformers'
    defaults for the architecture.

    Raises:
        KeyError: a required field is missing.
    """
    return {
        "vocab_size": config["vocab_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config.get("num_key_value_heads") or config["num_attention_heads"],
        "head_dim": head_dim(config),
        "embed_dim": config["hidden_size"],
        "num_experts": num_experts(config),
        "num_experts_per_tok": config["num_experts_per_tok"],
        "router_aux_loss_coef": router_aux_loss_coef(config),
        "max_seq_len": max_seq_len or config["max_position_embeddings"],
        "norm_eps": config.get("rms_norm_eps", norm_eps),
        "rope_base": rope_theta(config, default=rope_theta_default),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def router_aux_loss_coef(config: dict[str, Any]) -> float:
    """The weight of the load-balancing loss in the training loss: the file's ``router_aux_loss_coef``
    (transformers' default, 0.001, without it). It applies whether or not the file sets ``output_router_logits``,
    without which transformers leaves the loss out: fine-tuning a mixture of experts keeps its experts balanced."""
    return float(config.get("router_aux_loss_coef", 0.001))


def moe_blocks(model: TransformerDecoder) -> list[MoEFeedForward]:
    """The mixture-of-experts feed-forwards of ``model``'s layers, in order."""
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEFeedForward)]


def moe_fields(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` fields of the mixture-of-experts layers that Mixtral and Qwen3-MoE spell alike."""
    block = moe_blocks(model)[0]
    return {"num_experts_per_tok": block.top_k, "router_aux_loss_coef": model.router_aux_loss_coef}


def decoder_fields(model: TransformerDecoder) -> dict[str, Any]:
    """The ``config.json`` fields every family's ``hf_config`` shares, read off ``model``'s modules
    (``intermediate_size`` from the first dense feed-forward; none without one)."""
    attn = model.layers[0].self_attn
    vocab_size, embed_dim = model.embed_tokens.weight.shape
    dense = [layer.mlp for layer in model.layers if not isinstance(layer.mlp, MoEFeedForward)]
    return {
        "vocab_size": vocab_size,
        "hidden_size": embed_dim,
        **({"intermediate_size": dense[0].gate_proj.weight.shape[0]} if dense else {}),
        "num_hidden_layers": len(model.layers),
        "num_attention_heads": attn.num_heads,
        "num_key_value_heads": attn.num_kv_heads,
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm.eps,
        "rope_theta": attn.pos_embeddings.base,
        "tie_word_embeddings": model.tie_word_embeddings,
        "torch_dtype": str(model.embed_tokens.weight.dtype).removeprefix("torch."),
    }
