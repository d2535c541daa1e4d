"""Qwen3: public sizes, weight-name round trip, and parity with `transformers`."""

import pytest
import torch

from toolkit.models.qwen3 import (
    hf_key_to_tune,
    qwen3,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_14b,
    qwen3_32b,
    tune_key_to_hf,
)


@pytest.mark.parametrize(
    "builder,expected_billions",
    # Parameter counts the Hugging Face hub reports for each release's safetensors (tied embedding counted once).
    [
        (qwen3_0_6b, 0.596), (qwen3_1_7b, 1.721), (qwen3_4b, 4.022), (qwen3_8b, 8.191), (qwen3_14b, 14.768),
        (qwen3_32b, 32.762),
    ],
)
def test_public_sizes_on_meta(builder, expected_billions):
    with torch.device("meta"):
        model = builder()
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - expected_billions) < 0.001


def test_weight_names_round_trip():
    model = qwen3(
        vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=48,
        max_seq_len=16, tie_word_embeddings=True,
    )
    keys = list(model.state_dict())
    # Per-head norms: their width is head_dim, not the model width.
    assert model.state_dict()["layers.0.self_attn.q_norm.weight"].shape == (16,)
    hf_keys = [tune_key_to_hf(k) for k in keys]
    assert "model.layers.0.self_attn.k_norm.weight" in hf_keys and "lm_head.weight" not in hf_keys
    assert [hf_key_to_tune(k) for k in hf_keys] == keys


@pytest.mark.interop
def test_matches_transformers(hf_interop):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # head_dim * num_heads (64) differs from hidden_size (48), as in Qwen3 0.6B, 4B and 32B.
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=1_000_000.0,
        tie_word_embeddings=True,
    )
    hf_interop(transformers.Qwen3ForCausalLM(config), "qwen3")
