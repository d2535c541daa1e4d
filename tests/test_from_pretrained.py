"""toolkit.pretrained.from_pretrained: family discovery, dtype, sharded checkpoints, and its error messages."""

import importlib
import json

import pytest
import torch

from toolkit.errors import UserError
from toolkit.models import build_from_hf, hf_model_types
from toolkit.pretrained import from_pretrained


def test_every_family_declares_its_model_types():
    assert hf_model_types() == {
        "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3", "llama": "llama3", "mistral": "mistral",
        "mixtral": "mixtral", "phi3": "phi3",
        "qwen2": "qwen2_5", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe",
    }


def test_unknown_model_type_names_the_file_and_the_supported_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model"}))
    with pytest.raises(UserError) as e:
        from_pretrained(tmp_path)
    message = str(e.value)
    assert str(tmp_path / "config.json") in message and "'not_a_model'" in message
    assert "llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe" in message


def test_a_type_the_transformers_backend_cannot_train_names_the_file(tmp_path):
    # transformers builds GPT-2, but its blocks are not a ModuleList named `layers` (they are `h`).
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2}))
    with pytest.raises(UserError, match=r"config.json: GPT2LMHeadModel \(gpt2\): the transformers backend needs"):
        from_pretrained(tmp_path)


def test_missing_config_and_missing_field(tmp_path):
    with pytest.raises(UserError, match="config.json: not found"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 10}))
    with pytest.raises(UserError, match="missing field 'num_hidden_layers'"):
        from_pretrained(tmp_path)


@pytest.mark.interop
def test_sharded_checkpoint_in_bf16(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
    )
    hf_model = transformers.Qwen3ForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()

    model = from_pretrained(tmp_path, dtype=torch.bfloat16, max_seq_len=16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16 and model.max_seq_len == 16
    expected = hf_model.model.layers[1].mlp.down_proj.weight.to(torch.bfloat16)
    assert torch.equal(model.layers[1].mlp.down_proj.weight, expected)


@pytest.mark.parametrize(
    "family,size,key,supported",
    [
        ("llama3", "llama3_2_1b", "hidden_act", "swish"),
        ("mistral", "mistral_7b", "hidden_act", "silu"),
        ("qwen2_5", "qwen2_5_0_5b", "hidden_act", "silu"),
        ("qwen3", "qwen3_0_6b", "hidden_act", "silu"),
        ("phi3", "phi4_14b", "hidden_act", "silu"),
        ("gemma2", "gemma2_2b", "hidden_activation", "gelu_pytorch_tanh"),
        ("gemma3", "gemma3_1b", "hidden_activation", "gelu_pytorch_tanh"),
    ],
)
def test_an_activation_the_builder_does_not_compute_is_refused(tmp_path, family, size, key, supported):
    # The builders hard-code their activation: a config.json asking for another one used to load and give other
    # logits than transformers (a Llama with hidden_act "gelu": 8e-3 apart on logits of ~1).
    module = importlib.import_module(f"toolkit.models.{family}")
    with torch.device("meta"):
        config = module.hf_config(getattr(module, size)())
    (tmp_path / "config.json").write_text(json.dumps(config | {key: "gelu"}))
    with torch.device("meta"), pytest.raises(UserError, match=f"{key} 'gelu' is not supported"):
        build_from_hf(path=tmp_path)
    for accepted in ({key: supported}, {key: None}):  # the other spelling, and a file without the field
        (tmp_path / "config.json").write_text(json.dumps(config | accepted))
        with torch.device("meta"):
            build_from_hf(path=tmp_path)


def _architecture_read_by_transformers(config) -> dict:
    num_layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None) or ["sliding_attention"] * num_layers
    window = getattr(config, "sliding_window", None)
    scalar = getattr(config, "query_pre_attn_scalar", None)
    return {
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "windows": [window if t == "sliding_attention" else None for t in layer_types],
        "attn_softcap": getattr(config, "attn_logit_softcapping", None),
        "final_softcap": getattr(config, "final_logit_softcapping", None),
        "softmax_scale": None if scalar is None else scalar**-0.5,
        "rope_theta": config.rope_parameters["rope_theta"],
        "norm_eps": config.rms_norm_eps,
        "tied": config.tie_word_embeddings,
    }


def _architecture_read_by_us(model) -> dict:
    attention = [layer.self_attn for layer in model.layers]
    return {
        "head_dim": attention[0].head_dim,
        "windows": [a.sliding_window for a in attention],
        "attn_softcap": attention[0].logit_softcap,
        "final_softcap": model.final_logit_softcap,
        "softmax_scale": attention[0].softmax_scale,
        "rope_theta": attention[0].pos_embeddings.base,
        "norm_eps": model.norm.eps,
        "tied": model.tie_word_embeddings,
    }


@pytest.mark.interop
@pytest.mark.parametrize(
    "model_type,fields",
    [
        ("llama", {}),
        ("mistral", {}),  # no sliding_window: transformers' 4096
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"sliding_window": 32}),  # without use_sliding_window the window is off
        ("qwen3", {"sliding_window": 32}),
        ("phi3", {}),  # no sliding_window: transformers' None
        ("gemma2", {}),  # head_dim 256, query_pre_attn_scalar 256, window 4096, soft-caps 50 and 30
        ("gemma2", {"sliding_window": None, "attn_logit_softcapping": None}),
    ],
)
def test_a_config_without_optional_fields_reads_as_in_transformers(tmp_path, model_type, fields):
    """A config.json that leaves fields out means transformers' defaults for them; we used to build another
    architecture (Mistral and Gemma 2 without their 4096-token window, Qwen3 with hidden_size // heads as
    head_dim) or refuse it (Gemma 2 without soft-caps, Qwen2 with a window it does not switch on)."""
    transformers = pytest.importorskip("transformers")
    dims = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **dims, **fields}))
    with torch.device("meta"):
        model = build_from_hf(path=tmp_path)
    expected = _architecture_read_by_transformers(transformers.AutoConfig.from_pretrained(tmp_path))
    assert _architecture_read_by_us(model) == expected
