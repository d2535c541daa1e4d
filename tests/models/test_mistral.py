"""Mistral: public size, weight-name round trip, sliding-window attention, and parity with `transformers`."""

import pytest
import torch

from toolkit.models.mistral import hf_key_to_tune, mistral, mistral_7b, tune_key_to_hf


def test_public_size_on_meta():
    with torch.device("meta"):
        model = mistral_7b()
    # Mistral-7B-v0.3's safetensors hold 7,248,023,552 parameters.
    assert sum(p.numel() for p in model.parameters()) == 7_248_023_552


def tiny(sliding_window: int | None):
    return mistral(
        vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, embed_dim=32, intermediate_dim=48,
        max_seq_len=32, sliding_window=sliding_window,
    )


def test_weight_names_round_trip():
    keys = list(tiny(None).state_dict())
    assert [hf_key_to_tune(tune_key_to_hf(k)) for k in keys] == keys


def test_sliding_window_hides_distant_tokens():
    torch.manual_seed(0)
    model = tiny(sliding_window=4).eval()
    tokens = torch.randint(0, 64, (1, 12))
    changed = tokens.clone()
    changed[0, 0] = (tokens[0, 0] + 1) % 64
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    # Two layers of a 4-token window reach back 6 positions: position 6 still sees token 0, position 7 does not.
    assert not torch.allclose(a[0, 6], b[0, 6])
    torch.testing.assert_close(a[0, 7:], b[0, 7:], atol=0, rtol=0)


def test_sliding_window_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    model = tiny(sliding_window=4).eval()
    tokens = torch.randint(0, 64, (1, 14))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=1, max_seq_len=16)
        prefill = model(tokens[:, :6], input_pos=torch.arange(6))
        steps = [model(tokens[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(6, 14)]
        model.clear_caches()
    torch.testing.assert_close(prefill, full[:, :6], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 6:], atol=1e-5, rtol=0)


@pytest.mark.interop
@pytest.mark.parametrize("sliding_window", [None, 6])  # v0.3 (full attention) and v0.1 (a window on every layer)
def test_matches_transformers(hf_interop, sliding_window):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=1_000_000.0,
        sliding_window=sliding_window,
    )
    hf_interop(transformers.MistralForCausalLM(config), "mistral")
