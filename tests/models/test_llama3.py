"""Llama 3 builders, weight conversion, KV-cache decoding, and logits against `transformers`."""

import pytest
import torch

from toolkit.models.llama3 import (
    hf_config,
    hf_to_tune,
    llama3,
    llama3_1_8b,
    llama3_1_70b,
    llama3_2_1b,
    llama3_2_3b,
    meta_to_tune,
    tune_to_hf,
    tune_to_meta,
)
from toolkit.modules import Llama3RopeScaling


def tiny(tie: bool = False, scaling: Llama3RopeScaling | None = None):
    return llama3(
        vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
        max_seq_len=64, rope_base=500_000.0, rope_scaling=scaling, tie_word_embeddings=tie,
    )


@pytest.mark.parametrize(
    "builder,expected_billions",
    # Public parameter counts of each release (embedding counted once when tied).
    [(llama3_2_1b, 1.236), (llama3_2_3b, 3.213), (llama3_1_8b, 8.030), (llama3_1_70b, 70.554)],
)
def test_public_sizes_on_meta(builder, expected_billions):
    with torch.device("meta"):
        model = builder()
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e9 - expected_billions) < 0.001


def test_hf_and_meta_conversion_round_trip():
    torch.manual_seed(0)
    model = tiny()
    sd = model.state_dict()
    assert hf_to_tune(tune_to_hf(sd)).keys() == sd.keys()
    meta = tune_to_meta(sd, num_heads=4, num_kv_heads=2)
    assert "layers.0.attention.wq.weight" in meta
    back = meta_to_tune(meta, num_heads=4, num_kv_heads=2)
    for k in sd:
        torch.testing.assert_close(back[k], sd[k], atol=0, rtol=0)
    # The permutation is not the identity: Meta's q rows really differ from ours.
    assert not torch.equal(meta["layers.0.attention.wq.weight"], sd["layers.0.self_attn.q_proj.weight"])


def test_kv_cache_decoding_matches_full_forward():
    torch.manual_seed(0)
    model = tiny().eval()
    tokens = torch.randint(0, 97, (1, 12))
    with torch.no_grad():
        full = model(tokens)
        model.setup_caches(batch_size=1, max_seq_len=16)
        prefill = model(tokens[:, :8], input_pos=torch.arange(8))
        steps = [model(tokens[:, i : i + 1], input_pos=torch.tensor([i])) for i in range(8, 12)]
        model.clear_caches()
    torch.testing.assert_close(prefill, full[:, :8], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 8:], atol=1e-5, rtol=0)


@pytest.mark.interop
@pytest.mark.parametrize("tie", [False, True])
def test_logits_match_transformers(tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    scaling = Llama3RopeScaling(factor=8.0, original_max_position_embeddings=16)
    ours = tiny(tie=tie, scaling=scaling).eval()
    config = transformers.LlamaConfig(**{k: v for k, v in hf_config(ours).items() if k not in ("architectures", "model_type")})
    theirs = transformers.LlamaForCausalLM(config).eval()
    # Random HF weights loaded into our model: the conversion is exercised in the direction users need.
    hf_sd = theirs.state_dict()
    if tie:  # transformers lists the tied lm_head in state_dict(); save_pretrained does not write it
        del hf_sd["lm_head.weight"]
    ours.load_state_dict(hf_to_tune(hf_sd), strict=True)
    tokens = torch.randint(0, 97, (2, 40))  # longer than original_max_position_embeddings: scaling matters
    with torch.no_grad():
        expected = theirs(tokens).logits
        actual = ours(tokens)
    # Same fp32 math in a different order of operations: 1e-4 absolute on logits of magnitude ~1.
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)
