"""toolkit.models.from_pretrained: family discovery, dtype, sharded checkpoints, and its error messages."""

import importlib
import json

import pytest
import torch

from toolkit.errors import UserError
from toolkit.models import build_from_hf, from_pretrained, hf_model_types


def test_every_family_declares_its_model_types():
    assert hf_model_types() == {
        "gemma2": "gemma2", "llama": "llama3", "mistral": "mistral", "qwen2": "qwen2_5", "qwen3": "qwen3",
    }


def test_unknown_model_type_names_the_file_and_the_supported_types(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UserError) as e:
        from_pretrained(tmp_path)
    message = str(e.value)
    assert str(tmp_path / "config.json") in message and "'gpt2'" in message
    assert "llama, mistral, qwen2, qwen3" in message


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
        ("gemma2", "gemma2_2b", "hidden_activation", "gelu_pytorch_tanh"),
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
