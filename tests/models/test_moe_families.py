"""Mixtral and Qwen3-MoE: public sizes, the per-expert checkpoint layout against our stacked experts (streamed in and
out, the fused layout too, a wrong expert count refused), and parity with `transformers`: logits, the training loss
with its load-balancing term, and the export."""

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.checkpoint.test_export import read_all
from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.errors import UserError
from toolkit.models import build_from_hf
from toolkit.models.mixtral import lora_mixtral, mixtral, mixtral_8x7b, mixtral_8x22b
from toolkit.models.qwen3_moe import qwen3_moe, qwen3_moe_30b_a3b, qwen3_moe_235b_a22b, sparse_layers
from toolkit.modules.moe import MoEFeedForward
from toolkit.modules.peft import LoRAGroupedExperts, LoRALinear, adapter_modules, init_adapters, is_adapter_key
from toolkit.pretrained import from_pretrained
from toolkit.training import HFCheckpointer

FAMILIES = ["mixtral", "qwen3_moe"]


@pytest.mark.parametrize(
    "builder,expected_billions",
    # The parameter counts of each release's safetensors on the Hugging Face hub.
    [(qwen3_moe_30b_a3b, 30.53), (qwen3_moe_235b_a22b, 235.09), (mixtral_8x7b, 46.70), (mixtral_8x22b, 140.63)],
)
def test_public_sizes_on_meta(builder, expected_billions):
    with torch.device("meta"):
        model = builder()
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - expected_billions) < 0.01


def tiny(family: str, *, num_experts: int = 4) -> torch.nn.Module:
    """A seeded tiny model: Qwen3-MoE with a dense middle layer, Mixtral with a head_dim unlike width / heads."""
    torch.manual_seed(0)
    if family == "qwen3_moe":
        return qwen3_moe(
            vocab_size=96, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32,
            moe_intermediate_dim=16, intermediate_dim=48, num_experts=num_experts, num_experts_per_tok=2,
            mlp_only_layers=[1], max_seq_len=64,
        )
    return mixtral(
        vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=24,
        num_experts=num_experts, num_experts_per_tok=2, max_seq_len=64,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_names_round_trip(family):
    convert = importlib.import_module(f"toolkit.models.{family}")
    for key, tensor in tiny(family).state_dict().items():
        slices = convert.tune_key_to_hf_slices(key, tensor.shape[0])
        if slices is None:  # a whole tensor, named as the dense families name it (the MoE block renamed)
            hf_key = convert.tune_key_to_hf(key)
            assert convert.hf_key_to_parts(hf_key) is None and convert.hf_key_to_tune(hf_key) == key
            continue
        assert len(slices) == 4
        for expert, hf_key in enumerate(slices):
            (part,) = convert.hf_key_to_parts(hf_key)
            assert (part.key, part.index, part.rows) == (key, expert, None)
    if family == "mixtral":  # w1 = gate, w3 = up, w2 = down, in the block_sparse_moe block
        assert convert.tune_key_to_hf_slices("layers.1.mlp.experts.up_proj", 4)[3] == (
            "model.layers.1.block_sparse_moe.experts.3.w3.weight"
        )
        assert convert.tune_key_to_hf("layers.1.mlp.gate.weight") == "model.layers.1.block_sparse_moe.gate.weight"
    fused = convert.hf_key_to_parts("model.layers.0.mlp.experts.gate_up_proj")
    assert [(p.key, p.index, p.rows) for p in fused] == [
        ("layers.0.mlp.experts.gate_proj", None, (0, 2)), ("layers.0.mlp.experts.up_proj", None, (1, 2)),
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_save_writes_one_tensor_per_expert_and_loads_back(family, tmp_path):
    model = tiny(family)
    out = HFCheckpointer(model_family=family).save(model, tmp_path / "ckpt", max_shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    written = read_all(out)
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    down = "w2" if family == "mixtral" else "down_proj"
    assert torch.equal(written[f"model.layers.0.{block}.experts.3.{down}.weight"], model.layers[0].mlp.experts.down_proj[3])
    loaded = tiny(family)
    with torch.no_grad():
        for param in loaded.parameters():
            param.zero_()
    HFCheckpointer(str(out), model_family=family).load(loaded)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_save_from_dcp_writes_what_save_writes(family, tmp_path):
    import torch.distributed.checkpoint as dcp

    model = tiny(family)
    step = tmp_path / "checkpoints" / "step_1"
    dcp.save({f"model.{k}": v for k, v in model.state_dict().items()}, checkpoint_id=str(step))
    (step / "COMPLETE").write_text("{}")
    with torch.device("meta"):
        shape_only = tiny(family)
    checkpointer = HFCheckpointer(model_family=family)
    converted = checkpointer.save_from_dcp(shape_only, step, tmp_path / "converted", max_shard_bytes=4096)
    saved = checkpointer.save(model, tmp_path / "saved", max_shard_bytes=4096)
    names = sorted(p.name for p in saved.iterdir())
    assert names == sorted(p.name for p in converted.iterdir())
    for name in names:
        assert (converted / name).read_bytes() == (saved / name).read_bytes(), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("model_experts", [2, 8])
def test_another_number_of_experts_is_refused_in_one_line(family, model_experts, tmp_path):
    out = HFCheckpointer(model_family=family).save(tiny(family), tmp_path / "ckpt")
    with pytest.raises(UserError) as e:
        HFCheckpointer(str(out), model_family=family).load(tiny(family, num_experts=model_experts))
    message = str(e.value)
    assert f"the checkpoint has 4 experts per layer but the model has {model_experts}" in message
    assert str(out) in message and "\n" not in message


@pytest.mark.parametrize("family", FAMILIES)
def test_a_missing_expert_is_named(family, tmp_path):
    out = HFCheckpointer(model_family=family).save(tiny(family), tmp_path / "ckpt")
    weights = load_file(out / "model.safetensors")
    name = "w1" if family == "mixtral" else "gate_proj"
    missing = f"model.layers.0.{'block_sparse_moe' if family == 'mixtral' else 'mlp'}.experts.2.{name}.weight"
    del weights[missing]
    save_file(weights, str(out / "model.safetensors"))
    with pytest.raises(UserError, match=rf"lacks 1 weight\(s\) the model needs, e\.g\. '{missing}'"):
        HFCheckpointer(str(out), model_family=family).load(tiny(family))


@pytest.mark.parametrize("family", FAMILIES)
def test_another_top_k_in_the_checkpoints_config_is_refused_in_one_line(family, tmp_path):
    out = HFCheckpointer(model_family=family).save(tiny(family), tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 3}))
    with pytest.raises(UserError) as e:
        HFCheckpointer(str(out), model_family=family).load(tiny(family))
    message = str(e.value)
    assert "routes each token to num_experts_per_tok=3 experts but the model to 2" in message
    assert str(out) in message and "\n" not in message


def test_qwen3_moe_dense_layers_are_where_the_config_says():
    # Every decoder_sparse_step-th layer is sparse, unless listed in mlp_only_layers (transformers' rule).
    assert sparse_layers(num_layers=6, mlp_only_layers=[3], decoder_sparse_step=2) == [
        False, True, False, False, False, True,
    ]
    assert sparse_layers(num_layers=3) == [True, True, True]
    model = tiny("qwen3_moe")
    assert [isinstance(layer.mlp, MoEFeedForward) for layer in model.layers] == [True, False, True]


def test_mixtral_router_jitter_noise_is_refused_naming_the_key(tmp_path):
    from toolkit.models.mixtral import hf_config

    (tmp_path / "config.json").write_text(json.dumps(hf_config(tiny("mixtral")) | {"router_jitter_noise": 0.1}))
    with pytest.raises(UserError) as e:
        build_from_hf(path=tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: router_jitter_noise 0.1 is not supported")
    assert "\n" not in message


def test_lora_adapts_attention_and_refuses_the_experts():
    with torch.device("meta"):
        model = lora_mixtral(
            vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=24,
            num_experts=4, num_experts_per_tok=2, max_seq_len=64, lora_attn_modules=["q_proj", "v_proj"],
        )
        adapted = sorted(name for name, module in model.named_modules() if isinstance(module, LoRALinear))
        assert adapted == [f"layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
        with pytest.raises(UserError, match="apply_lora_to_mlp: .*mixtures of experts"):
            lora_mixtral(
                vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32,
                intermediate_dim=24, num_experts=4, num_experts_per_tok=2, max_seq_len=64,
                lora_attn_modules=["q_proj"], apply_lora_to_mlp=True,
            )


def test_apply_lora_to_experts_adapts_every_experts_block_and_nothing_else():
    with torch.device("meta"):
        model = lora_mixtral(
            vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=24,
            num_experts=4, num_experts_per_tok=2, max_seq_len=64, lora_attn_modules=[], apply_lora_to_experts=True,
        )
    assert sorted(adapter_modules(model)) == [f"layers.{i}.mlp.experts" for i in range(2)]
    assert all(isinstance(m, LoRAGroupedExperts) for m in adapter_modules(model).values())


# --- Against transformers --------------------------------------------------------------------------------------


def hf_model(family: str, **changes):
    """A seeded random ``transformers`` model of ``family``: Qwen3-MoE with a dense middle layer
    (``mlp_only_layers``), Mixtral with a sliding window shorter than the test sequences. The routers' weights are
    drawn large, so that no token's choice of experts is a near-tie that float rounding could flip."""
    transformers = pytest.importorskip("transformers")
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{
            "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1],
            "max_position_embeddings": 64, "rope_theta": 1_000_000.0, "router_aux_loss_coef": 0.1, **changes,
        })
    else:
        config = transformers.MixtralConfig(**{
            "vocab_size": 96, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
            "num_experts_per_tok": 2, "max_position_embeddings": 64, "sliding_window": 8,
            "router_aux_loss_coef": 0.1, **changes,
        })
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
    return model.eval()


@pytest.mark.interop
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(family, hf_interop):
    hf_interop(hf_model(family), family)


@pytest.mark.interop
def test_qwen3_moe_with_yarn_matches_transformers_beyond_the_original_context(hf_interop):
    # Qwen3-MoE's long-context setting: YaRN over an original context of 16 positions, which the check's rows
    # (24 tokens, 20 more generated) pass; read from config.json and written back on export.
    hf_interop(hf_model("qwen3_moe", rope_parameters={"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 16}), "qwen3_moe")


@pytest.mark.interop
@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_with_the_load_balancing_term_matches_transformers(family, tmp_path):
    theirs = hf_model(family)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    tokens = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], torch.full((1, 1), CROSS_ENTROPY_IGNORE_INDEX)], dim=1)  # ours come shifted
    theirs.train()
    ours.train()
    expected = theirs(tokens, labels=tokens, output_router_logits=True)
    assert 0.1 * expected.aux_loss > 0.1, "the load-balancing term is a visible part of the loss"
    # The summed loss over the row's 23 trained tokens; fp32 of magnitude ~5 summed in another order: 1e-5.
    torch.testing.assert_close(ours(tokens, labels=labels) / 23, expected.loss, atol=1e-5, rtol=0)


@pytest.mark.interop
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_checkpoints_in_and_out_as_transformers_writes_them(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    theirs = hf_model(family)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = from_pretrained(tmp_path / "hf").eval()
    out = HFCheckpointer(str(tmp_path / "hf"), model_family=family).save(ours, tmp_path / "ours", max_shard_bytes=20_000)
    assert len(list(out.glob("*.safetensors"))) > 1
    # The same tensors under the same names as transformers' own files.
    expected, written = read_all(tmp_path / "hf"), read_all(out)
    assert written.keys() == expected.keys()
    for key in expected:
        assert torch.equal(written[key], expected[key]), key
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        # fp32 with the same math in a different order: 1e-4 absolute on logits of magnitude ~1.
        torch.testing.assert_close(reloaded(tokens).logits, theirs(tokens).logits, atol=1e-4, rtol=0)


@pytest.mark.interop
@pytest.mark.parametrize("family", FAMILIES)
def test_the_fused_in_memory_layout_of_transformers_5_loads_too(family, tmp_path):
    # transformers 5 holds each layer's experts fused (gate_up_proj, down_proj): a checkpoint written from its
    # state_dict as it is in memory.
    theirs = hf_model(family)
    state = theirs.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    folder = tmp_path / "fused"
    theirs.config.save_pretrained(folder)
    save_file({key: value.contiguous() for key, value in state.items()}, str(folder / "model.safetensors"))
    tokens = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(from_pretrained(folder)(tokens), theirs(tokens).logits, atol=1e-4, rtol=0)
    # Fused experts of another count (3 in every layer) say so.
    state = {key: value[:3] if ".experts." in key else value for key, value in state.items()}
    save_file({key: value.contiguous() for key, value in state.items()}, str(folder / "model.safetensors"))
    with pytest.raises(UserError, match="the checkpoint has 3 experts per layer but the model has 4"):
        from_pretrained(folder)


@pytest.mark.interop
# (Routers with expert adapters too: tests/recipes/test_moe_recipes.py, through the LoRA recipe.)
@pytest.mark.parametrize("experts,router", [(False, False), (True, False), (False, True)],
                         ids=["attention", "attention_and_experts", "attention_and_router"])
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_adapters_onto_transformers_and_tune_merge_merges_them(family, experts, router, tmp_path):
    # With adapters on the experts too: PEFT's target_parameters on transformers' fused gate_up_proj and down_proj
    # (toolkit.checkpoint.peft_experts), and tune merge writes them into the per-expert checkpoint. With the routers
    # trained whole too: PEFT's modules_to_save (transformers' mlp.gate; Mixtral's files say block_sparse_moe.gate).
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from toolkit.models import lora_build_from_hf
    from toolkit.checkpoint.peft import merge_adapter_into_checkpoint, save_peft_adapter

    hf_model(family).save_pretrained(tmp_path / "base")
    model = lora_build_from_hf(path=tmp_path / "base", lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                               apply_lora_to_experts=experts, train_router=router)
    HFCheckpointer(str(tmp_path / "base"), model_family=family).load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_b" in name:
                param.normal_(0.0, 0.3 if ".experts." in name else 0.1, generator=generator)
            if name.endswith("mlp.gate.weight") and router:  # what training the router would do: other routing
                param.copy_(param.flip(0))
    model.eval()
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family=family)
    assert json.loads((adapter / "adapter_config.json").read_text())["modules_to_save"] == (
        ["mlp.gate"] if router else None
    )
    if router:  # written and merged, not loaded back into a model here: refused in one line, with what to do
        from toolkit.checkpoint.peft import adapter_linear

        with pytest.raises(UserError, match=r"modules_to_save=\['mlp.gate'\] \(modules trained whole\).*tune merge"):
            adapter_linear(adapter, model_family=family)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(base, adapter).eval()
    tokens = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ours = model(tokens)
        # fp32, the same math in a different order: 1e-4 on logits of magnitude ~1.
        torch.testing.assert_close(theirs(tokens).logits, ours, atol=1e-4, rtol=0)
        with theirs.disable_adapter():  # the adapters count: without them the logits differ
            assert (theirs(tokens).logits - ours).abs().max() > 1e-2
        if experts:  # so do the experts' alone
            for module in model.modules():
                if isinstance(module, LoRAGroupedExperts):
                    module.disabled = True
            assert (model(tokens) - ours).abs().max() > 1e-2
        if router:  # and the routers: on the base's routers the logits differ (10x the tolerance they agree within)
            for name, module in model.named_modules():
                if name.endswith("mlp.gate"):
                    module.weight.copy_(module.weight.flip(0))
            assert (model(tokens) - ours).abs().max() > 1e-3
    merged = merge_adapter_into_checkpoint(tmp_path / "base", adapter, tmp_path / "merged")
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        torch.testing.assert_close(reloaded(tokens).logits, ours, atol=1e-4, rtol=0)


def test_expert_adapters_with_dropout_have_no_peft_form_and_say_so(tmp_path):
    # PEFT's adapters on parameters refuse dropout: written without it, the adapter would not be what trained.
    from toolkit.checkpoint.peft import save_peft_adapter

    with torch.device("meta"):
        model = lora_mixtral(
            vocab_size=96, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=32, intermediate_dim=24,
            num_experts=4, num_experts_per_tok=2, max_seq_len=64, lora_attn_modules=["q_proj"],
            apply_lora_to_experts=True, lora_dropout=0.1,
        )
    with pytest.raises(UserError, match=r"^apply_lora_to_experts: .*lora_dropout=0.1; export the merged model$"):
        save_peft_adapter(model, tmp_path / "adapter", model_family="mixtral")
    assert not (tmp_path / "adapter").exists()


@pytest.mark.interop
def test_tune_merge_of_an_expert_adapter_onto_a_model_without_experts_names_the_missing_weight(tmp_path):
    from tests.checkpoint.test_peft_export import save_base
    from toolkit.models import lora_build_from_hf
    from toolkit.checkpoint.peft import merge_adapter_into_checkpoint, save_peft_adapter

    hf_model("mixtral").save_pretrained(tmp_path / "moe")
    model = lora_build_from_hf(path=tmp_path / "moe", lora_attn_modules=["q_proj"], apply_lora_to_experts=True)
    HFCheckpointer(str(tmp_path / "moe"), model_family="mixtral").load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family="mixtral")
    dense = save_base(tmp_path / "dense")
    with pytest.raises(UserError, match=r"no base weight 'model\.layers\.0\.mlp\.experts\.(down|gate_up)_proj'"):
        merge_adapter_into_checkpoint(dense, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()
