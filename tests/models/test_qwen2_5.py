"""Qwen2.5: public sizes, weight-name round trip, and parity with `transformers`."""

import pytest
import torch

from toolkit.models.qwen2_5 import (
    hf_key_to_tune,
    qwen2_5,
    qwen2_5_0_5b,
    qwen2_5_1_5b,
    qwen2_5_3b,
    qwen2_5_7b,
    qwen2_5_14b,
    qwen2_5_32b,
    qwen2_5_72b,
    tune_key_to_hf,
)


@pytest.mark.parametrize(
    "builder,expected_billions",
    # Parameter counts the Hugging Face hub reports for each release's safetensors (tied embedding counted once).
    [
        (qwen2_5_0_5b, 0.494), (qwen2_5_1_5b, 1.544), (qwen2_5_3b, 3.086), (qwen2_5_7b, 7.616),
        (qwen2_5_14b, 14.770), (qwen2_5_32b, 32.764), (qwen2_5_72b, 72.706),
    ],
)
def test_public_sizes_on_meta(builder, expected_billions):
    with torch.device("meta"):
        model = builder()
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - expected_billions) < 0.001


def test_weight_names_round_trip():
    model = qwen2_5(
        vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=48, max_seq_len=16
    )
    keys = list(model.state_dict())
    assert "layers.0.self_attn.q_proj.bias" in keys and "layers.0.self_attn.o_proj.bias" not in keys
    hf_keys = [tune_key_to_hf(k) for k in keys]
    assert "model.layers.0.self_attn.k_proj.bias" in hf_keys and "lm_head.weight" in hf_keys
    assert [hf_key_to_tune(k) for k in hf_keys] == keys


@pytest.mark.interop
@pytest.mark.parametrize("tie", [True, False])
def test_matches_transformers(hf_interop, tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=1_000_000.0, tie_word_embeddings=tie,
    )
    hf_interop(transformers.Qwen2ForCausalLM(config), "qwen2_5")
