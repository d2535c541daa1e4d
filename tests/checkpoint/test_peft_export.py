"""PEFT-format adapters: save and load, offline merge (`tune merge`), and interop with `peft`/`transformers`."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from toolkit.cli.main import main as tune
from toolkit.errors import UserError
from toolkit.pretrained import from_pretrained
from toolkit.models.llama3 import llama3, lora_llama3
from toolkit.modules.peft import get_adapter_params, init_adapters, is_adapter_key
from toolkit.training import HFCheckpointer, materialize
from toolkit.checkpoint.peft import adapter_linear, load_peft_adapter, merge_adapter_into_checkpoint, save_peft_adapter

DIMS = dict(
    vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64,
    rope_base=10_000.0,
)
TARGETS = dict(
    lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True, apply_lora_to_output=True
)


def save_base(path: Path) -> Path:
    torch.manual_seed(0)
    model = llama3(**DIMS)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    # Small shards: the merge must reproduce a sharded checkpoint with its index.
    return HFCheckpointer(None, model_family="llama3").save(model, path, max_shard_bytes=40_000)


def adapted_model(base_dir: Path, *, use_dora: bool, seed: int | None = 1) -> nn.Module:
    """A LoRA/DoRA Llama with the base loaded from ``base_dir`` and, given a seed, random nonzero adapters."""
    with torch.device("meta"):
        model = lora_llama3(**DIMS, **TARGETS, lora_rank=4, lora_alpha=8.0, lora_dropout=0.05, use_dora=use_dora)
    materialize(model, device=torch.device("cpu"))
    HFCheckpointer(str(base_dir), model_family="llama3").load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in get_adapter_params(model).values():
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("use_dora", [False, True])
def test_save_writes_peft_names_and_config_and_loads_back(tmp_path: Path, use_dora: bool):
    base_dir = save_base(tmp_path / "base")
    model = adapted_model(base_dir, use_dora=use_dora)
    out = save_peft_adapter(model, tmp_path / "adapter", model_family="llama3", base_model_name_or_path=str(base_dir))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # no temporary folder left
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"], config["use_dora"]) == (4, 8.0, 0.05, use_dora)
    hf_names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
    assert config["target_modules"] == sorted(hf_names)
    assert config["base_model_name_or_path"] == str(base_dir)
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert "base_model.model.lm_head.lora_A.weight" in keys
    assert ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector" in keys) == use_dora
    assert len(keys) == 15 * (3 if use_dora else 2)

    fresh = adapted_model(base_dir, use_dora=use_dora, seed=None)
    load_peft_adapter(fresh, out, model_family="llama3")
    with torch.no_grad():
        assert torch.equal(fresh(tokens()), model(tokens()))


def test_loading_a_mismatched_adapter_names_the_problem(tmp_path: Path):
    base_dir = save_base(tmp_path / "base")
    out = save_peft_adapter(adapted_model(base_dir, use_dora=False), tmp_path / "adapter", model_family="llama3")
    with torch.device("meta"):
        other = lora_llama3(**DIMS, **TARGETS, lora_rank=8, lora_alpha=8.0)
    materialize(other, device=torch.device("cpu"))
    with pytest.raises(UserError, match="r=4"):
        load_peft_adapter(other, out, model_family="llama3")
    with torch.device("meta"):
        fewer = lora_llama3(**DIMS, lora_attn_modules=["q_proj"], lora_rank=4, lora_alpha=8.0)
    with pytest.raises(UserError, match="modules differ"):
        load_peft_adapter(fewer, out, model_family="llama3")
    with pytest.raises(UserError, match="missing"):
        load_peft_adapter(fewer, tmp_path, model_family="llama3")


@pytest.mark.parametrize("use_dora", [False, True])
def test_tune_merge_equals_the_adapted_model(tmp_path: Path, use_dora: bool, capsys: pytest.CaptureFixture):
    base_dir = save_base(tmp_path / "base")
    model = adapted_model(base_dir, use_dora=use_dora)
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family="llama3")
    merged_dir = tmp_path / "merged"
    assert tune(["merge", "--base", str(base_dir), "--adapter", str(adapter), "--output", str(merged_dir)]) == 0
    assert sorted(p.name for p in merged_dir.iterdir()) == sorted(p.name for p in base_dir.iterdir())
    merged = from_pretrained(merged_dir).eval()
    with torch.no_grad():
        # fp32 rounding only (see tests/modules/test_lora.py).
        torch.testing.assert_close(merged(tokens()), model(tokens()), atol=1e-5, rtol=0)
    # An existing output is never overwritten without --overwrite: one error line, exit code 1.
    assert tune(["merge", "--base", str(base_dir), "--adapter", str(adapter), "--output", str(merged_dir)]) == 2
    assert "already exists" in capsys.readouterr().err


def test_merge_output_stays_apart_from_its_inputs(tmp_path: Path):
    # Into, over, or inside the base or adapter folder: --overwrite would delete an input, or the output would be
    # mixed into one.
    base_dir = save_base(tmp_path / "base")
    adapter = save_peft_adapter(adapted_model(base_dir, use_dora=False), tmp_path / "adapter", model_family="llama3")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for output, refusal in [
        (base_dir, f"is the base {base_dir}"),
        (tmp_path, f"holds the base {base_dir}"),
        (base_dir / "merged", f"is inside the base {base_dir}"),
        (adapter / "merged", f"is inside the adapter {adapter}"),
    ]:
        with pytest.raises(UserError) as info:
            merge_adapter_into_checkpoint(base_dir, adapter, output, overwrite=True)
        assert str(info.value).startswith(f"--output: {output} {refusal}"), info.value
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_merge_refuses_an_adapter_for_another_model(tmp_path: Path):
    base_dir = save_base(tmp_path / "base")
    adapter = save_peft_adapter(adapted_model(base_dir, use_dora=False), tmp_path / "adapter", model_family="llama3")
    torch.manual_seed(0)
    tied_model = llama3(**dict(DIMS, tie_word_embeddings=True))
    tied = HFCheckpointer(None, model_family="llama3").save(tied_model, tmp_path / "tied")
    with pytest.raises(UserError, match="lm_head.weight"):
        merge_adapter_into_checkpoint(tied, adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change,refused", [
    ({"target_modules": ["q_proj", "down_proj"]}, r"down_proj.*gate_proj.*up_proj.*all three or none"),
    ({"target_modules": ["q_proj", "gate_proj", "up_proj"]}, r"down_proj.*all three or none"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"'embed_tokens'.*q_proj.*lm_head"),
    ({"target_modules": ["qkv_proj"]}, r"'qkv_proj'"),
    ({"target_modules": []}, r"target_modules"),
    ({"target_modules": r".*\.(q_proj|v_proj)"}, r"target_modules.*pattern"),
    ({"layers_to_transform": [0]}, r"layers_to_transform=\[0\]"),
    ({"use_rslora": True}, r"use_rslora"),
    ({"rank_pattern": {"q_proj": 8}}, r"rank_pattern=\{'q_proj': 8\} is not supported"),
    ({"target_parameters": ["mlp.experts.w1"]}, r"target_parameters=\['mlp.experts.w1'\] is not supported"),
    ({"target_parameters": ["mlp.experts.down_proj"], "alpha_pattern": {"down_proj": 0}}, r"alpha_pattern="),
    # Adapters on the experts (PEFT's form, as ours are written) merge offline, but do not load into a model here.
    ({"target_parameters": ["mlp.experts.down_proj"]}, r"adapters on the experts.*tune merge"),
])
def test_adapter_targets_our_builders_cannot_express_are_refused(tmp_path: Path, change: dict, refused: str):
    base_dir = save_base(tmp_path / "base")
    adapter = save_peft_adapter(adapted_model(base_dir, use_dora=False), tmp_path / "adapter", model_family="llama3")
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **change}))
    with pytest.raises(UserError, match=rf"^{re.escape(str(config_file))}: .*{refused}"):
        adapter_linear(adapter, model_family="llama3")


def test_adapter_linear_needs_an_adapter_folder(tmp_path: Path):
    with pytest.raises(UserError, match="adapter_config.json: missing; is .* a PEFT adapter folder"):
        adapter_linear(tmp_path, model_family="llama3")


def hf_llama(base_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


@pytest.mark.interop
@pytest.mark.parametrize("use_dora", [False, True])
def test_peft_loads_our_adapter_and_tune_merge_loads_in_transformers(tmp_path: Path, use_dora: bool):
    peft = pytest.importorskip("peft")
    base_dir = save_base(tmp_path / "base")
    model = adapted_model(base_dir, use_dora=use_dora)
    adapter = save_peft_adapter(
        model, tmp_path / "adapter", model_family="llama3", base_model_name_or_path=str(base_dir)
    )
    with torch.no_grad():
        ours = model(tokens())
        assert (ours - from_pretrained(base_dir)(tokens())).abs().max() > 1e-2  # the adapters matter
        theirs = peft.PeftModel.from_pretrained(hf_llama(base_dir), adapter).eval()(tokens()).logits
        # fp32, the same math in a different order (as in the family interop tests): 1e-4 on logits of ~1.
        torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)
        merge_adapter_into_checkpoint(base_dir, adapter, tmp_path / "merged")
        torch.testing.assert_close(hf_llama(tmp_path / "merged")(tokens()).logits, ours, atol=1e-4, rtol=0)


@pytest.mark.interop
def test_we_load_an_adapter_peft_wrote(tmp_path: Path):
    peft = pytest.importorskip("peft")
    base_dir = save_base(tmp_path / "base")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True, init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(5)
    theirs = peft.get_peft_model(hf_llama(base_dir), config).eval()
    theirs.save_pretrained(tmp_path / "adapter")
    with torch.device("meta"):
        model = lora_llama3(
            **DIMS, lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, lora_alpha=8, use_dora=True,
            apply_lora_to_mlp=False,
        )
    # down_proj alone is not a builder option: the mismatch is reported, not silently dropped.
    materialize(model, device=torch.device("cpu"))
    with pytest.raises(UserError, match="down_proj"):
        load_peft_adapter(model, tmp_path / "adapter", model_family="llama3")
    with pytest.raises(UserError, match="adapter_config.json: .*down_proj"):
        adapter_linear(tmp_path / "adapter", model_family="llama3")
    config.target_modules = ["q_proj", "v_proj"]
    theirs = peft.get_peft_model(hf_llama(base_dir), config).eval()
    theirs.save_pretrained(tmp_path / "adapter2")
    HFCheckpointer(str(base_dir), model_family="llama3").load(model, ignore_missing=is_adapter_key)
    load_peft_adapter(model, tmp_path / "adapter2", model_family="llama3")
    # The plain builder with the settings of PEFT's adapter_config.json builds the same model.
    rebuilt = llama3(**DIMS, linear=adapter_linear(tmp_path / "adapter2", model_family="llama3"))
    rebuilt.load_state_dict(model.state_dict())
    with torch.no_grad():
        expected = theirs(tokens()).logits
        assert (expected - hf_llama(base_dir)(tokens()).logits).abs().max() > 1e-2  # the adapters matter
        torch.testing.assert_close(model.eval()(tokens()), expected, atol=1e-4, rtol=0)
        assert torch.equal(rebuilt.eval()(tokens()), model(tokens()))
