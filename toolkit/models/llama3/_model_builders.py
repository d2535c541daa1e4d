"""Public Llama 3.x sizes (numbers from each release's params/config), a tiny demo size, and any size read from
a Hugging Face ``config.json``."""

from typing import Any

from toolkit.errors import UserError
from toolkit.models import _hf_config
from toolkit.models._decoder import LinearFactory, plain_linear
from toolkit.models.llama3._component_builders import llama3
from toolkit.modules import Llama3RopeScaling, TransformerDecoder

# config.json model types this family builds (toolkit.pretrained.from_pretrained looks here). Llama 2 checkpoints
# say "llama" too: they are this architecture without rotary scaling.
HF_MODEL_TYPES: tuple[str, ...] = ("llama",)

def llama3_demo(
    *, vocab_size: int = 384, max_seq_len: int = 256, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A ~1M-parameter Llama 3 for the CPU demo and tests (byte-level vocabulary)."""
    return llama3(
        vocab_size=vocab_size, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=128, intermediate_dim=384,
        max_seq_len=max_seq_len, rope_base=10_000.0, linear=linear,
    )


def llama3_2_1b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 3.2 1B."""
    return llama3(
        vocab_size=128_256, num_layers=16, num_heads=32, num_kv_heads=8, embed_dim=2048, intermediate_dim=8192,
        max_seq_len=max_seq_len, rope_scaling=Llama3RopeScaling(factor=32.0), tie_word_embeddings=True, linear=linear,
    )


def llama3_2_3b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 3.2 3B."""
    return llama3(
        vocab_size=128_256, num_layers=28, num_heads=24, num_kv_heads=8, embed_dim=3072, intermediate_dim=8192,
        max_seq_len=max_seq_len, rope_scaling=Llama3RopeScaling(factor=32.0), tie_word_embeddings=True, linear=linear,
    )


def llama3_1_8b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 3.1 8B."""
    return llama3(
        vocab_size=128_256, num_layers=32, num_heads=32, num_kv_heads=8, embed_dim=4096, intermediate_dim=14_336,
        max_seq_len=max_seq_len, rope_scaling=Llama3RopeScaling(factor=8.0), linear=linear,
    )


def llama3_1_70b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 3.1 70B."""
    return llama3(
        vocab_size=128_256, num_layers=80, num_heads=64, num_kv_heads=8, embed_dim=8192, intermediate_dim=28_672,
        max_seq_len=max_seq_len, rope_scaling=Llama3RopeScaling(factor=8.0), linear=linear,
    )


def llama3_3_70b(*, max_seq_len: int = 131_072, linear: LinearFactory = plain_linear) -> TransformerDecoder:
    """Llama 3.3 70B (the Llama 3.1 70B architecture, retrained)."""
    return llama3_1_70b(max_seq_len=max_seq_len, linear=linear)


def from_hf_config(
    config: dict[str, Any], *, max_seq_len: int | None = None, linear: LinearFactory = plain_linear
) -> TransformerDecoder:
    """A Llama with the dimensions of a Hugging Face ``LlamaForCausalLM`` ``config.json`` (as a dict).

    Args:
        config: the parsed ``config.json``.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.
        linear: makes each projection (the LoRA builders pass adapter layers).

    Raises:
        KeyError: a required field is missing.
        UserError: a feature this builder does not have (biases, an explicit head_dim, other rope scaling, an
            activation other than SiLU).
    """
    _hf_config.check_activation(config, supported=_hf_config.SILU)
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise UserError("Llama checkpoints with attention_bias or mlp_bias are not supported")
    if _hf_config.head_dim(config) * config["num_attention_heads"] != config["hidden_size"]:
        raise UserError(
            "Llama checkpoints whose head_dim differs from hidden_size / num_attention_heads are not supported"
        )
    return llama3(
        linear=linear,
        vocab_size=config["vocab_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
        embed_dim=config["hidden_size"],
        intermediate_dim=config["intermediate_size"],
        max_seq_len=max_seq_len or config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_base=_hf_config.rope_theta(config, default=10_000.0),
        rope_scaling=_hf_config.llama3_rope_scaling(config),
        tie_word_embeddings=config.get("tie_word_embeddings", False),
    )
