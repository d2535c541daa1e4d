"""Phi-3 architecture (Phi-4): the public size, the fused Hugging Face tensors split on load and joined on export,
parity with `transformers`, and the configs refused."""

import json

import pytest
import torch
from safetensors.torch import load_file

from toolkit.errors import UserError
from toolkit.models import build_from_hf
from toolkit.models.phi3 import hf_config, hf_key_to_parts, hf_key_to_tune, phi3, phi4_14b, tune_key_to_hf
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer

# GQA (4 query heads over 2 key/value heads): q, k and v rows of the fused qkv_proj differ in number.
DIMS = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rope_theta=250_000.0, rms_norm_eps=1e-5, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)


def test_public_size_on_meta():
    with torch.device("meta"):
        model = phi4_14b()
    # microsoft/phi-4: 14.66B parameters (its safetensors' total_size, 29.3 GB in bf16, over two bytes each).
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 14.66) < 0.01
    config = hf_config(model)
    expected = {
        "num_hidden_layers": 40, "hidden_size": 5120, "num_attention_heads": 40, "num_key_value_heads": 10,
        "intermediate_size": 17920, "vocab_size": 100352, "rope_theta": 250_000.0, "max_position_embeddings": 16384,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "head_dim": 128,
    }
    assert {key: config[key] for key in expected} == expected


def test_phi4s_config_json_builds_phi4_14b(tmp_path):
    # The architecture fields of microsoft/phi-4's config.json (written by transformers 4.47).
    config = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 17920, "max_position_embeddings": 16384,
        "num_attention_heads": 40, "num_hidden_layers": 40, "num_key_value_heads": 10,
        "original_max_position_embeddings": 16384, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 250000,
        "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 100352, "pad_token_id": 100349,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        ours, public = build_from_hf(path=tmp_path), phi4_14b()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in public.state_dict().items()}
    assert hf_config(ours) == hf_config(public)


def test_weight_names_split_and_join():
    model = phi3(
        vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, embed_dim=32, intermediate_dim=48,
        max_seq_len=16,
    )
    keys = list(model.state_dict())
    assert tune_key_to_hf("layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj.weight"
    assert tune_key_to_hf("layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    parts = hf_key_to_parts("model.layers.0.self_attn.qkv_proj.weight")
    assert [(p.key, p.rows) for p in parts] == [
        ("layers.0.self_attn.q_proj.weight", (0, 3)), ("layers.0.self_attn.k_proj.weight", (1, 3)),
        ("layers.0.self_attn.v_proj.weight", (2, 3)),
    ]
    assert [p.key for p in hf_key_to_parts("model.layers.0.mlp.gate_up_proj.weight")] == [
        "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    ]
    whole = [k for k in keys if hf_key_to_parts(tune_key_to_hf(k)) is None]
    assert [hf_key_to_tune(tune_key_to_hf(k)) for k in whole] == whole
    assert len(whole) == len(keys) - 5  # q, k, v, gate, up
    with pytest.raises(KeyError):
        hf_key_to_tune("model.layers.0.self_attn.qkv_proj.weight")


def hf_phi3(tied: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**DIMS, tie_word_embeddings=tied))
    with torch.no_grad():  # ones would hide a swapped or dropped norm
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


@pytest.mark.interop
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_matches_transformers_and_exports_the_fused_tensors_bitwise(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    hf_model = hf_phi3(tied)
    hf_model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()  # through config.json and the checkpointer's split
    tokens = torch.randint(0, DIMS["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        # fp32 with the same math in a different order: 1e-4 absolute on logits of magnitude ~1.
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)

    out = HFCheckpointer(str(tmp_path / "hf"), model_family="phi3").save(ours, tmp_path / "ours")
    original, exported = load_file(tmp_path / "hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert exported.keys() == original.keys()
    for key in original:  # qkv_proj and gate_up_proj joined back exactly as transformers stored them
        assert torch.equal(exported[key], original[key]), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-4, rtol=0)


@pytest.mark.interop
def test_a_fused_tensor_of_the_wrong_size_is_refused(tmp_path):
    hf_model = hf_phi3(tied=False)
    hf_model.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"num_key_value_heads": 4}))
    model = build_from_hf(path=tmp_path / "hf")
    with pytest.raises(UserError, match=r"'model.layers.0.self_attn.qkv_proj.weight' has shape \(128, 64\) but the "
                                        r"model expects \(192, 64\)"):
        HFCheckpointer(str(tmp_path / "hf"), model_family="auto").load(model)


@pytest.mark.parametrize(
    "fields,refused",
    [
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor 0.75 is not supported"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
         "rope_scaling type 'longrope' is not supported for phi3"),
        ({"sliding_window": 2047}, "sliding_window 2047 is not supported for phi3"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_features_the_builder_does_not_compute_are_refused(tmp_path, fields, refused):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "phi3", **DIMS, **fields}))
    with torch.device("meta"), pytest.raises(UserError, match=refused) as e:
        build_from_hf(path=tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "\n" not in str(e.value)


@pytest.mark.interop
@pytest.mark.parametrize(
    "lora",
    [
        dict(lora_attn_modules=["q_proj", "v_proj"]),  # qkv_proj's k rows without adapter: a zero block
        dict(lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True, use_dora=True),
    ],
    ids=["lora-q-v", "dora-all"],
)
def test_peft_loads_the_adapter_written_on_the_fused_modules(tmp_path, lora):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.models.test_lora_builders import lora_model, perturb_adapters, save_base, tokens
    from toolkit.modules.peft import get_merged_state_dict
    from toolkit.training.peft import merge_adapter_into_checkpoint, save_peft_adapter

    _, base_dir = save_base("phi3", tmp_path / "base")
    model = lora_model("phi3", base_dir, **lora)
    perturb_adapters(model)
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family="phi3")
    config = json.loads((adapter / "adapter_config.json").read_text())
    fused = 3 if "k_proj" in lora["lora_attn_modules"] else 2  # the most of our adapters on one fused module
    assert (config["r"], config["lora_alpha"]) == (4 * fused, 8.0 * fused)  # lora_alpha / r as ours: 8 / 4
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    merged = HFCheckpointer(str(base_dir), model_family="phi3").save(
        model, tmp_path / "merged", state_dict=get_merged_state_dict(model)
    )
    # tune merge: the fused adapter merged into the base's files, in HF's names.
    offline = merge_adapter_into_checkpoint(base_dir, adapter, tmp_path / "offline")
    with torch.no_grad():
        ours = model(tokens())
        torch.testing.assert_close(theirs(tokens()).logits, ours, atol=1e-4, rtol=0)
        for folder in (merged, offline):
            merged_hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            torch.testing.assert_close(merged_hf(tokens()).logits, ours, atol=1e-4, rtol=0)
