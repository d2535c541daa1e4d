"""Gemma 2: public sizes, weight-name round trip, its blocks, and parity with `transformers`."""

import pytest
import torch

from toolkit.models.gemma2 import gemma2, gemma2_2b, gemma2_9b, gemma2_27b, hf_key_to_tune, tune_key_to_hf
from toolkit.modules.gemma2 import GemmaRMSNorm


@pytest.mark.parametrize(
    "builder,expected",
    # Parameter counts of the released safetensors (the embedding is tied, counted once).
    [(gemma2_2b, 2_614_341_888), (gemma2_9b, 9_241_705_984), (gemma2_27b, 27_227_128_320)],
)
def test_public_sizes_on_meta(builder, expected):
    with torch.device("meta"):
        model = builder()
    assert sum(p.numel() for p in model.parameters()) == expected


def tiny(**overrides):
    args = dict(
        vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=48,
        max_seq_len=32, query_pre_attn_scalar=24, sliding_window=4,
    )
    return gemma2(**(args | overrides))


def test_weight_names_round_trip():
    keys = list(tiny().state_dict())
    assert "layers.0.pre_feedforward_layernorm.weight" in keys and "output.weight" not in keys
    assert [hf_key_to_tune(tune_key_to_hf(k)) for k in keys] == keys


def test_zero_norm_weight_is_plain_rms_normalization():
    x = torch.randn(3, 8)
    expected = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()
    torch.testing.assert_close(GemmaRMSNorm(8)(x), expected)


def test_logits_are_soft_capped_and_local_layers_slide():
    torch.manual_seed(0)
    model = tiny(final_logit_softcap=0.5).eval()
    with torch.no_grad():
        model.embed_tokens.weight.mul_(100)  # large logits, to reach the cap
        logits = model(torch.randint(0, 64, (1, 10)))
    assert logits.abs().max() <= 0.5
    windows = [layer.self_attn.sliding_window for layer in model.layers]
    assert windows == [4, None]


def test_kv_cache_matches_full_forward(check_kv_cache):
    check_kv_cache(tiny(attn_logit_softcap=1.0), 64)


@pytest.mark.interop
def test_matches_transformers(hf_interop):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Small caps and a larger init put scores and logits where tanh bends; a 6-token window is shorter than the
    # 24-token inputs and the 30-token generation; head_dim * num_heads (64) differs from hidden_size (48) and
    # query_pre_attn_scalar (20) from head_dim, as in Gemma 2 27B.
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=20,
        sliding_window=6, attn_logit_softcapping=2.0, final_logit_softcapping=3.0, initializer_range=0.2,
    )
    hf_interop(transformers.Gemma2ForCausalLM(config), "gemma2")
