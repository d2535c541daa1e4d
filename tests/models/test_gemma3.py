"""Gemma 3 (text): public sizes and the release configs that describe them, the local/global layer pattern with its
two rotary embeddings, weight names of both checkpoint layouts, parity with `transformers` (``Gemma3ForCausalLM``
and the language model of ``Gemma3ForConditionalGeneration``) and the export back, and the configs refused."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from toolkit.errors import UserError
from toolkit.models import build_from_hf
from toolkit.models.gemma3 import (
    gemma3,
    gemma3_1b,
    gemma3_4b,
    gemma3_12b,
    gemma3_27b,
    hf_config,
    hf_key_to_tune,
    skipped_hf_key,
    tune_key_to_hf,
)
from toolkit.modules import LinearRopeScaling
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer

# The architecture fields of google/gemma-3-1b-it's config.json, and the text_config of the 4B, 12B and 27B releases
# (Gemma3ForConditionalGeneration), which leave out what transformers' Gemma3TextConfig defaults to.
RELEASES = {
    "1b": (gemma3_1b, {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "attention_bias": False,
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
    }),
    "4b": (gemma3_4b, {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34}),
    "12b": (gemma3_12b, {
        "hidden_size": 3840, "intermediate_size": 15360, "num_attention_heads": 16, "num_hidden_layers": 48,
        "num_key_value_heads": 8,
    }),
    "27b": (gemma3_27b, {
        "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
        "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
    }),
}
SCALED = {"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}

TEXT = dict(
    vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, query_pre_attn_scalar=20, sliding_window=6,
    rope_theta=5000.0, rope_local_base_freq=300.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
    layer_types=["sliding_attention", "full_attention"] * 2, initializer_range=0.2,
)
"""A tiny Gemma 3: both kinds of layer (one global every two), a 6-token window shorter than the 24-token inputs,
rotary bases and a linear scaling that differ from the defaults, head_dim * num_heads (64) unlike hidden_size (48),
query_pre_attn_scalar (20) unlike head_dim, and a larger init so that every term shows in the logits."""


def test_1b_has_the_released_parameter_count():
    with torch.device("meta"):
        model = gemma3_1b()
    # google/gemma-3-1b-pt's safetensors (the embedding is tied, counted once).
    assert sum(p.numel() for p in model.parameters()) == 999_885_952


@pytest.mark.parametrize("size", RELEASES)
def test_each_release_config_builds_its_size(tmp_path, size):
    builder, fields = RELEASES[size]
    config = fields if size == "1b" else {
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"model_type": "gemma3_text", **fields, **SCALED}, "vision_config": {"hidden_size": 1152},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        ours, public = build_from_hf(path=tmp_path), builder()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in public.state_dict().items()}
    assert hf_config(ours) == hf_config(public)
    windows = [layer.self_attn.sliding_window for layer in ours.layers]
    assert windows[:6] == [windows[0]] * 5 + [None] and windows[0] == (512 if size == "1b" else 1024)


def tiny(**overrides):
    args = dict(
        vocab_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=48,
        max_seq_len=32, query_pre_attn_scalar=24, sliding_window=4, sliding_window_pattern=3,
        rope_scaling=LinearRopeScaling(factor=2.0),
    )
    return gemma3(**(args | overrides))


def test_local_and_global_layers_have_their_window_and_rotary_embedding():
    model = tiny()
    attention = [layer.self_attn for layer in model.layers]
    assert [a.sliding_window for a in attention] == [4, 4, None, 4]
    local, global_ = attention[0].pos_embeddings, attention[2].pos_embeddings
    assert attention[1].pos_embeddings is local and attention[3].pos_embeddings is local
    assert (local.base, local.scaling) == (10_000.0, None)
    assert (global_.base, global_.scaling) == (1_000_000.0, LinearRopeScaling(factor=2.0))
    # Linear scaling: position p of the global layers turns as position p / 2 would unscaled.
    unscaled = tiny(rope_scaling=None).layers[2].self_attn.pos_embeddings
    torch.testing.assert_close(global_.cos[10], unscaled.cos[5])
    assert attention[0].q_norm is not None and attention[0].k_norm is not None and attention[0].logit_softcap is None


def test_weight_names_of_both_layouts():
    keys = list(tiny().state_dict())
    assert "layers.0.self_attn.q_norm.weight" in keys and "output.weight" not in keys
    assert [hf_key_to_tune(tune_key_to_hf(k)) for k in keys] == keys
    assert tune_key_to_hf("layers.0.self_attn.k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    for prefix in ("language_model.model.", "model.language_model."):  # as published; as transformers 5 saves
        assert hf_key_to_tune(prefix + "layers.1.mlp.up_proj.weight") == "layers.1.mlp.up_proj.weight"
    assert hf_key_to_tune("language_model.lm_head.weight") == "output.weight"
    assert skipped_hf_key("model.vision_tower.encoder.layers.0.mlp.fc1.weight") == "vision_tower"
    assert skipped_hf_key("multi_modal_projector.mm_input_projection_weight") == "multi_modal_projector"
    assert skipped_hf_key("model.language_model.norm.weight") is None
    with pytest.raises(KeyError):
        hf_key_to_tune("vision_tower.vision_model.post_layernorm.weight")


def test_the_exported_config_reads_back_as_the_same_architecture(tmp_path):
    model = tiny()
    config = hf_config(model)
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    rebuilt = build_from_hf(path=tmp_path)
    assert hf_config(rebuilt) == config
    assert rebuilt.layers[2].self_attn.pos_embeddings.scaling == LinearRopeScaling(factor=2.0)


def test_kv_cache_matches_full_forward(check_kv_cache):
    check_kv_cache(tiny(), 64)


@pytest.mark.interop
def test_matches_transformers(hf_interop):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_interop(transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TEXT)), "gemma3")


def _rename_keys(file, rename) -> None:
    tensors = load_file(file)
    save_file({rename(key): tensor for key, tensor in tensors.items()}, file, metadata={"format": "pt"})


@pytest.mark.interop
def test_the_language_model_of_a_multimodal_checkpoint_loads_and_exports_text_only(tmp_path, caplog):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vision = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    hf_model = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4)
    ).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    hf_model.save_pretrained(tmp_path / "hf")
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    # transformers writes the layout Google published: language_model.model.*, vision_tower.*.
    assert any(k.startswith("language_model.model.") for k in saved) and any("vision_tower" in k for k in saved)
    tokens = torch.randint(0, TEXT["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits

    with caplog.at_level(logging.WARNING, logger="toolkit.checkpoint.hf"):
        ours = from_pretrained(tmp_path / "hf").eval()
    vision_tensors = sum(1 for k in saved if skipped_hf_key(k))
    assert f"skipped {vision_tensors} tensors the gemma3 model does not use" in caplog.text
    with torch.no_grad():
        # fp32 with the same math in a different order: 1e-4 absolute on logits of magnitude ~1.
        torch.testing.assert_close(ours(tokens), expected, atol=1e-4, rtol=0)

    out = HFCheckpointer(str(tmp_path / "hf"), model_family="auto").save(ours, tmp_path / "text")
    exported = load_file(out / "model.safetensors")
    assert all(key.startswith("model.layers.") or key in ("model.embed_tokens.weight", "model.norm.weight")
               for key in exported)
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3_text"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-4, rtol=0)

    # transformers 5's module names (model.language_model.*, model.vision_tower.*), as other tools save them.
    _rename_keys(tmp_path / "hf" / "model.safetensors",
                 lambda key: "model." + key.replace("language_model.model.", "language_model."))
    renamed = from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(renamed(tokens), ours(tokens))


@pytest.mark.parametrize(
    "fields,refused",
    [
        ({"layer_types": ["full_attention", "sliding_attention"] * 2}, r"layer_types \['full_attention', .* are not"),
        ({"layer_types": ["full_attention"] * 4}, r"layer_types \['full_attention', .* are not"),
        ({"sliding_window": None}, "sliding_window null is not supported"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention True is not supported"),
        ({"attention_bias": True}, "attention_bias True is not supported"),
        ({"tie_word_embeddings": False}, "tie_word_embeddings false is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"},
                              "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
         "rope type 'linear' of the sliding_attention layers is not supported"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ],
)
@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma3"])
def test_features_the_builder_does_not_compute_are_refused(tmp_path, fields, refused, model_type):
    text = {**TEXT, **fields}
    config = {"model_type": "gemma3", "text_config": text} if model_type == "gemma3" else {"model_type": model_type,
                                                                                           **text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.device("meta"), pytest.raises(UserError, match=refused) as e:
        build_from_hf(path=tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "\n" not in str(e.value)
