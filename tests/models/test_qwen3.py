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


@pytest.mark.interop
def test_yarn_matches_transformers_beyond_the_original_context(hf_interop):
    # YaRN over an original context of 16 positions: the check's 24-token rows and 20 generated tokens go past it,
    # where the stretched frequencies and the cos/sin magnitude (1 + 0.1 ln 4) decide the logits.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16},
    )
    hf_interop(transformers.Qwen3ForCausalLM(config), "qwen3")


def test_yarn_frequencies_are_transformers_to_float32_rounding():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from toolkit.modules import YarnRopeScaling

    # Qwen3's long-context setting, and the optional knobs (beta_fast/slow, mscale, a given attention_factor).
    for factor, original, head_dim, base, extra in [
        (4.0, 32_768, 128, 1e6, {}), (8.0, 4096, 64, 5e5, dict(beta_fast=16, beta_slow=2)),
        (4.0, 1024, 32, 1e4, dict(mscale=0.707, mscale_all_dim=0.707)),
        (3.0, 1024, 32, 1e4, dict(attention_factor=1.3)),
    ]:
        config = transformers.Qwen3Config(
            head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=4 * original,
            rope_parameters={"rope_type": "yarn", "rope_theta": base, "factor": factor,
                             "original_max_position_embeddings": original, **extra},
        )
        expected, magnitude = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        scaling = YarnRopeScaling(factor=factor, original_max_position_embeddings=original, **extra)
        plain = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ours = scaling.apply(plain, base=base, head_dim=head_dim)
        torch.testing.assert_close(ours, expected.double(), rtol=1e-6, atol=0)
        assert scaling.magnitude == pytest.approx(magnitude, rel=1e-12)


def test_yarn_factor_is_a_builder_key_and_a_bad_one_is_refused_in_one_line():
    from tests.launch import run_tune

    with torch.device("meta"):
        model = qwen3_8b(yarn_factor=4.0)
    scaling = model.layers[0].self_attn.pos_embeddings.scaling
    assert (scaling.factor, scaling.original_max_position_embeddings) == (4.0, 32_768)
    result = run_tune("validate", "lora_finetune/qwen3_8b_lora_128k", "model.yarn_factor=1")
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "model.yarn_factor" in line and "1" in line, line
