"""Llama 2 and Llama 3.3 sizes, and every `model_type: llama` checkpoint against `transformers`."""

import pytest
import torch

from toolkit.models.llama2 import llama2_7b, llama2_13b, llama2_70b
from toolkit.models.llama3 import llama3_3_70b


@pytest.mark.parametrize(
    "builder,expected",
    # Parameter counts of the released checkpoints.
    [
        (llama2_7b, 6_738_415_616), (llama2_13b, 13_015_864_320), (llama2_70b, 68_976_648_192),
        (llama3_3_70b, 70_553_706_496),
    ],
)
def test_public_sizes_on_meta(builder, expected):
    with torch.device("meta"):
        model = builder()
    assert sum(p.numel() for p in model.parameters()) == expected


@pytest.mark.interop
@pytest.mark.parametrize("version", ["llama2", "llama3.1", "llama3.2"])
def test_matches_transformers(hf_interop, version):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    # Llama 2: multi-head attention, rotary base 10,000. Llama 3.1: grouped-query attention and rotary scaling
    # (with original_max_position_embeddings below the input length, so the scaling matters). 3.2: tied output.
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )
    if version == "llama2":
        config = transformers.LlamaConfig(**common, num_key_value_heads=4, rope_theta=10_000.0, rms_norm_eps=1e-5)
    else:
        scaling = {
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
        }
        config = transformers.LlamaConfig(
            **common, num_key_value_heads=2, rope_parameters=scaling, tie_word_embeddings=version == "llama3.2"
        )
    hf_interop(transformers.LlamaForCausalLM(config), "llama3")
