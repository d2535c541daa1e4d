"""Phi-3 architecture (Phi-4, Phi-4-mini, Phi-3.5-mini): the public sizes, the fused Hugging Face tensors split on
load and joined on export, partial rotary and LongRoPE, parity with `transformers`, and the configs refused."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from toolkit.errors import UserError
from toolkit.models import build_from_hf
from toolkit.models.phi3 import (
    hf_config,
    hf_key_to_parts,
    hf_key_to_tune,
    phi3,
    phi4_14b,
    phi4_mini,
    tune_key_to_hf,
)
from toolkit.modules import LongRopeRotaryEmbeddings, LongRopeScaling
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer, materialize

# GQA (4 query heads over 2 key/value heads): q, k and v rows of the fused qkv_proj differ in number.
DIMS = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rope_theta=250_000.0, rms_norm_eps=1e-5, bos_token_id=1,
    eos_token_id=2, pad_token_id=0,
)
# LongRoPE over 16 tokens of original context (a quarter of max_position_embeddings), with random factors, so that
# a swapped, dropped or misaligned one shows: 8 per head for full rotary (Phi-3.5-mini), the first 6 for 12 of the
# 16 features (Phi-4-mini's partial_rotary_factor 0.75).
ORIGINAL = 16
_FACTORS = torch.Generator().manual_seed(3)
_SHORT, _LONG = (1 + torch.rand(8, generator=_FACTORS)).tolist(), (1 + 4 * torch.rand(8, generator=_FACTORS)).tolist()
ROPES = {
    "phi4-mini": dict(partial_rotary_factor=0.75, original_max_position_embeddings=ORIGINAL, rope_scaling={
        "type": "longrope", "short_factor": _SHORT[:6], "long_factor": _LONG[:6]}),
    "phi3.5-mini": dict(original_max_position_embeddings=ORIGINAL, rope_scaling={
        "type": "longrope", "short_factor": _SHORT, "long_factor": _LONG}),
    "partial-only": dict(partial_rotary_factor=0.75),
}


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


def test_phi4_mini_public_size_on_meta():
    with torch.device("meta"):
        model = phi4_mini()
    # microsoft/Phi-4-mini-instruct: 3,836,021,760 parameters (tied embeddings, counted once).
    assert sum(p.numel() for p in model.parameters()) == 3_836_021_760
    rope = model.layers[0].self_attn.pos_embeddings
    assert isinstance(rope, LongRopeRotaryEmbeddings) and (rope.rotary_dim, rope.head_dim) == (96, 128)
    assert rope.scaling.magnitude == pytest.approx(1.190238)  # sqrt(1 + ln 32 / ln 4096)


def test_phi4_minis_config_json_builds_phi4_mini(tmp_path):
    # The architecture fields of microsoft/Phi-4-mini-instruct's config.json (written by transformers 4.45).
    with torch.device("meta"):
        public = phi4_mini()
    scaling = public.layers[0].self_attn.pos_embeddings.scaling
    config = {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "max_position_embeddings": 131072,
        "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75, "rms_norm_eps": 1e-05,
        "rope_scaling": {"long_factor": list(scaling.long_factor), "short_factor": [1.0] * 48, "type": "longrope"},
        "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "vocab_size": 200064,
        "pad_token_id": 199999, "full_attn_mod": 1, "interpolate_factor": 1, "lm_head_bias": False,
    }
    assert scaling.long_factor[:3] == (1.0, 1.118320672, 1.250641126) and scaling.long_factor[-1] == 47.77
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        ours = build_from_hf(path=tmp_path)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in public.state_dict().items()}
    assert ours.layers[0].self_attn.pos_embeddings.scaling == scaling
    exported = hf_config(ours)
    assert exported == hf_config(public)
    # As the file has them (the window, longer than the context, is written as none).
    keys = [key for key in config if key not in ("sliding_window", "pad_token_id", "full_attn_mod",
                                                 "interpolate_factor", "lm_head_bias")]
    assert {key: exported[key] for key in keys} == {key: config[key] for key in keys}
    assert exported["sliding_window"] is None

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


def hf_phi3(tied: bool, **fields):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**DIMS, tie_word_embeddings=tied, **fields))
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
@pytest.mark.parametrize("rope", ROPES, ids=list(ROPES))
def test_partial_rotary_and_longrope_match_transformers_below_and_past_the_original_context(tmp_path, rope):
    transformers = pytest.importorskip("transformers")
    hf_model = hf_phi3(tied=True, **ROPES[rope])
    hf_model.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for seq_len in (12, ORIGINAL, ORIGINAL + 1, 40):  # short factors up to 16 tokens, long ones past them
            tokens = torch.randint(0, DIMS["vocab_size"], (2, seq_len), generator=generator)
            expected = hf_model(tokens).logits
            torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)
            # Explicit positions (packed rows, context-parallel chunks) choose the factors on the device.
            positions = torch.arange(seq_len).expand(2, seq_len)
            torch.testing.assert_close(ours(tokens, input_pos=positions), expected, atol=1e-4, rtol=0)
        if "rope_scaling" in ROPES[rope]:  # the switch is seen: one more token changes the earlier logits
            tokens = torch.randint(0, DIMS["vocab_size"], (1, ORIGINAL + 1), generator=generator)
            longer, shorter = hf_model(tokens).logits[:, :ORIGINAL], hf_model(tokens[:, :ORIGINAL]).logits
            assert (longer - shorter).abs().max() > 1e-3  # (logits of ~1, the parity tolerance 1e-4)
            torch.testing.assert_close(ours(tokens)[:, :ORIGINAL], longer, atol=1e-4, rtol=0)

    out = HFCheckpointer(str(tmp_path / "hf"), model_family="phi3").save(ours, tmp_path / "ours")
    written, original = (json.loads((folder / "config.json").read_text()) for folder in (out, tmp_path / "hf"))
    assert transformers.Phi3Config(**written).rope_parameters == transformers.Phi3Config(**original).rope_parameters
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, DIMS["vocab_size"], (2, 40), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, hf_model(tokens).logits, atol=1e-4, rtol=0)


def test_longrope_picks_one_table_per_forward_by_its_largest_position():
    scaling = LongRopeScaling(short_factor=(1.0, 1.5), long_factor=(3.0, 7.0), original_max_position_embeddings=8,
                              factor=4.0)
    rope = LongRopeRotaryEmbeddings(8, max_seq_len=32, base=100.0, scaling=scaling, rotary_dim=4)
    x = torch.randn(2, 3, 12, 8, generator=torch.Generator().manual_seed(0))  # [b, n_h, s, h_d]
    # 12 tokens: past the original 8, so the long factors for all of them, with or without explicit positions.
    whole = rope(x)
    torch.testing.assert_close(rope(x, torch.arange(12)), whole, rtol=0, atol=0)
    assert torch.equal(whole[..., 4:], x[..., 4:])  # the features past rotary_dim pass through
    # Packed rows: documents of 8 and 4 tokens; no position reaches 8, so the short factors, as for 8 tokens alone.
    packed = torch.cat([torch.arange(8), torch.arange(4)]).expand(2, 12)
    torch.testing.assert_close(rope(x, packed)[..., :8, :], rope(x[..., :8, :]), rtol=0, atol=0)
    assert not torch.allclose(rope(x[..., :8, :]), whole[..., :8, :])
    # The magnitude applies to both tables: sqrt(1 + ln 4 / ln 8).
    torch.testing.assert_close(rope.cos[0], torch.full((4,), (1 + math.log(4) / math.log(8)) ** 0.5))
    torch.testing.assert_close(rope.cos[8], rope.cos[0])  # the long table's position 0


def test_longropes_tables_built_on_the_meta_device_are_rebuilt_as_built_eagerly():
    # Recipes build on the meta device (the memory plan counts the buffers there) and materialize after.
    scaling = LongRopeScaling(short_factor=(1.0, 1.5), long_factor=(3.0, 7.0), original_max_position_embeddings=8,
                              factor=4.0)
    with torch.device("meta"):
        lazy = LongRopeRotaryEmbeddings(8, max_seq_len=32, base=100.0, scaling=scaling, rotary_dim=4)
    assert lazy.cos.shape == (8 + 32, 4)
    materialize(lazy, device=torch.device("cpu"))
    eager = LongRopeRotaryEmbeddings(8, max_seq_len=32, base=100.0, scaling=scaling, rotary_dim=4)
    assert torch.equal(lazy.cos, eager.cos) and torch.equal(lazy.sin, eager.sin)


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


def test_phi3_5_mini_style_files_build_longrope_on_every_feature(tmp_path):
    # Phi-3-mini-128k's first config.json called LongRoPE "su"; its window, as Phi-3.5-mini's, is no shorter than its
    # context (here exactly as long).
    rope_scaling = {"type": "su", "short_factor": _SHORT, "long_factor": _LONG}
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "phi3", **DIMS, "sliding_window": 64, "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": rope_scaling,
    }))
    with torch.device("meta"):
        model = build_from_hf(path=tmp_path)
    rope = model.layers[0].self_attn.pos_embeddings
    assert isinstance(rope, LongRopeRotaryEmbeddings) and rope.rotary_dim == rope.head_dim == 16
    assert rope.scaling == LongRopeScaling(short_factor=tuple(_SHORT), long_factor=tuple(_LONG),
                                           original_max_position_embeddings=ORIGINAL, factor=64 / ORIGINAL)


@pytest.mark.parametrize(
    "fields,refused",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported for phi3"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0] * 8}},
         r"rope_scaling short_factor: 8 numbers expected \(one per rotated feature pair\), got \[1.0\]"),
        ({"partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 6,
                                                          "long_factor": [1.0] * 5 + ["x"]}},
         "rope_scaling long_factor: 6 numbers expected"),
        ({"partial_rotary_factor": 0.7}, "partial_rotary_factor 0.7 rotates 11 of each head's 16 features"),
        # Phi-3-mini 4k's window (2047 of 4096) is shorter than the context: refused; a longer one is none.
        ({"sliding_window": 32}, r"sliding_window 32 is not supported for phi3 \(only null or at least "
                                 r"max_position_embeddings, 64\)"),
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
    from toolkit.checkpoint.peft import merge_adapter_into_checkpoint, save_peft_adapter

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
