"""LoRA/DoRA/QLoRA builders of every family: a LoRA model starts as its base, QLoRA stores the base in NF4, every
public size wraps the right architecture, and exported adapters load in `peft` onto the `transformers` model."""

import importlib
from pathlib import Path

import pytest
import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.models import build_from_hf
from toolkit.models._lora import ATTN_MODULES, MLP_MODULES
from toolkit.modules import LinearRopeScaling, LongRopeScaling
from toolkit.modules.peft import (
    LoRALinear,
    NF4Linear,
    get_adapter_params,
    get_merged_state_dict,
    init_adapters,
    is_adapter_key,
    is_nf4,
)
from toolkit.training import HFCheckpointer
from toolkit.checkpoint.peft import adapter_linear, fill_adapter_model, save_peft_adapter

# Tiny architectures that keep each family's quirks: Llama 2's multi-head attention, Mistral's sliding window and
# explicit head_dim, Qwen2.5's q/k/v biases (untied output, so the output adapter is exercised), Qwen3's q/k norms
# with a head_dim unlike embed_dim / num_heads (tied), Phi-3's fused qkv_proj and gate_up_proj in the checkpoint
# (GQA, so q, k and v rows differ in number) and Phi-4-mini's partial rotary and LongRoPE (the 12 test tokens past the
# original 8: the long factors), Gemma 2's sandwich norms, soft-capping and local layers, Gemma 3's q/k norms, local
# and global layers with their two rotary bases (the global one scaled).
# Every projection holds a multiple of 64 values, as NF4 needs.
DIMS = {
    "llama2": dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=4, embed_dim=64, intermediate_dim=128),
    "mistral": dict(
        vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=64, intermediate_dim=128,
        sliding_window=8,
    ),
    "qwen2_5": dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128),
    "qwen3": dict(
        vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, embed_dim=64, intermediate_dim=128,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=64, intermediate_dim=128,
        partial_rotary_factor=0.75, rope_scaling=LongRopeScaling(
            short_factor=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5), long_factor=(1.0, 2.0, 3.0, 5.0, 8.0, 13.0),
            original_max_position_embeddings=8, factor=4.0,
        ),
    ),
    "gemma2": dict(
        vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=64, intermediate_dim=128,
        query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcap=50.0, final_logit_softcap=30.0,
    ),
    "gemma3": dict(
        vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, embed_dim=64, intermediate_dim=128,
        query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=2, rope_scaling=LinearRopeScaling(4.0),
    ),
}
FAMILIES = sorted(DIMS)
TIED = {"qwen3", "gemma2", "gemma3"}
MAX_SEQ_LEN = 32


def family_module(family: str):
    return importlib.import_module(f"toolkit.models.{family}")


def builders(family: str):
    module = family_module(family)
    return getattr(module, family), getattr(module, f"lora_{family}")


def all_targets(family: str) -> dict:
    return dict(lora_attn_modules=list(ATTN_MODULES), apply_lora_to_mlp=True, apply_lora_to_output=family not in TIED)


def tokens() -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def save_base(family: str, path: Path) -> tuple[nn.Module, Path]:
    """A random base model of ``family`` (norms and biases perturbed, so a dropped one shows in the logits), saved
    in Hugging Face layout, as a user would download it."""
    plain, _ = builders(family)
    torch.manual_seed(0)
    model = plain(**DIMS[family], max_seq_len=MAX_SEQ_LEN).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model, HFCheckpointer(None, model_family=family).save(model, path)


def lora_model(family: str, base_dir: Path, **lora) -> nn.Module:
    """The family's LoRA model with the base loaded from ``base_dir`` (through the checkpointer, as the recipe does)
    and adapters initialized."""
    _, build = builders(family)
    model = build(**DIMS[family], max_seq_len=MAX_SEQ_LEN, lora_rank=4, lora_alpha=8.0, **lora)
    HFCheckpointer(str(base_dir), model_family=family).load(model, ignore_missing=is_adapter_key)
    init_adapters(model)
    return model.eval()


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_model_starts_as_its_base(family: str, use_dora: bool, tmp_path: Path):
    base, base_dir = save_base(family, tmp_path / "base")
    model = lora_model(family, base_dir, **all_targets(family), use_dora=use_dora)
    base_keys = set(base.state_dict())
    assert {k for k in model.state_dict() if not is_adapter_key(k)} == base_keys  # a base checkpoint loads as is
    adapted = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert len(adapted) == DIMS[family]["num_layers"] * 7 + (family not in TIED)
    with torch.no_grad():
        # B = 0 (and DoRA's magnitude = the base rows' norms) adds exactly zero: bitwise the base's logits.
        assert torch.equal(model(tokens()), base(tokens()))


@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_stores_every_layer_projection_in_nf4(family: str, tmp_path: Path):
    plain, _ = builders(family)
    _, base_dir = save_base(family, tmp_path / "base")
    model = lora_model(family, base_dir, lora_attn_modules=["q_proj", "v_proj"], quantize_base=True)
    for layer in model.layers:
        projections = {n: getattr(layer.self_attn, n) for n in ATTN_MODULES}
        projections |= {n: getattr(layer.mlp, n) for n in MLP_MODULES}
        for name, module in projections.items():
            # Adapted or not, every projection's frozen weight is NF4 (Dettmers et al., 2023); biases are not.
            assert is_nf4(module.weight), name
            assert isinstance(module, LoRALinear if name in ("q_proj", "v_proj") else NF4Linear), name
            assert module.bias is None or not is_nf4(module.bias)
        assert (layer.self_attn.q_proj.bias is not None) == (family == "qwen2_5")
    assert not is_nf4(model.embed_tokens.weight)
    if model.output is not None:
        assert type(model.output) is nn.Linear and not is_nf4(model.output.weight)  # unadapted output: model dtype
    # The QLoRA model computes the plain model with its dequantized weights (float32 rounding apart).
    dense = plain(**DIMS[family], max_seq_len=MAX_SEQ_LEN).eval()
    dense.load_state_dict(get_merged_state_dict(model))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), dense(tokens()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_builder_arguments_are_checked(family: str):
    _, build = builders(family)
    with torch.device("meta"):
        with pytest.raises(UserError, match="unknown"):
            build(**DIMS[family], max_seq_len=MAX_SEQ_LEN, lora_attn_modules=["qkv_proj"])
        with pytest.raises(UserError, match="no adapters"):
            build(**DIMS[family], max_seq_len=MAX_SEQ_LEN, lora_attn_modules=[])
        if family in TIED:
            with pytest.raises(UserError, match="ties"):
                build(**DIMS[family], max_seq_len=MAX_SEQ_LEN, lora_attn_modules=["q_proj"], apply_lora_to_output=True)


def public_sizes() -> list[tuple[str, str]]:
    sizes = []
    for family in FAMILIES + ["llama3"]:
        names = family_module(family).__all__
        sizes += [(family, n.removeprefix("lora_")) for n in names if n.startswith("lora_") and n != f"lora_{family}"]
    return sizes


@pytest.mark.parametrize("family,size", public_sizes(), ids=lambda v: v)
def test_every_public_size_has_lora_and_qlora_builders_of_that_size(family: str, size: str):
    module = family_module(family)
    lora_builder, qlora_builder = getattr(module, f"lora_{size}"), getattr(module, f"qlora_{size}")
    assert (lora_builder.__name__, qlora_builder.__name__) == (f"lora_{size}", f"qlora_{size}")
    with torch.device("meta"):
        base = getattr(module, size)()
        lora = lora_builder(lora_attn_modules=["q_proj", "v_proj"])
        qlora = qlora_builder(lora_attn_modules=["q_proj", "v_proj"])
    shapes = {k: v.shape for k, v in base.state_dict().items()}
    assert {k: v.shape for k, v in lora.state_dict().items() if not is_adapter_key(k)} == shapes
    assert len(get_adapter_params(lora)) == 2 * 2 * len(base.layers)
    assert is_nf4(qlora.layers[0].mlp.up_proj.weight) and not is_nf4(lora.layers[0].mlp.up_proj.weight)


def perturb_adapters(model: nn.Module) -> None:
    """Nonzero adapters (B = 0 would compute the base whatever the adapters' placement)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))


@pytest.mark.parametrize("targets", ["attention", "all"])
@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_plain_builder_rebuilds_the_model_of_a_saved_adapter(family: str, use_dora: bool, targets: str, tmp_path):
    # What `tune run generate/eval adapter_dir=...` does with a plain `model`: the adapter's settings come from its
    # adapter_config.json, the projections from the family's builder.
    _, base_dir = save_base(family, tmp_path / "base")
    lora = dict(lora_attn_modules=["k_proj", "o_proj"]) if targets == "attention" else all_targets(family)
    model = lora_model(family, base_dir, **lora, use_dora=use_dora)
    perturb_adapters(model)
    if family == "phi3" and use_dora and targets == "attention":  # DoRA's k rows alone: no PEFT form on qkv_proj
        with pytest.raises(UserError, match=r"qkv_proj: DoRA on \['k_proj'\] only cannot be written"):
            save_peft_adapter(model, tmp_path / "adapter", model_family=family)
        return
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family=family)
    if family == "phi3":  # one adapter on the fused qkv_proj / gate_up_proj: not split back into ours
        with pytest.raises(UserError, match="adapters on the fused .* cannot be loaded into our separate projections"):
            adapter_linear(adapter, model_family=family)
        return
    plain, _ = builders(family)
    linear = adapter_linear(adapter, model_family=family)
    rebuilt = plain(**DIMS[family], max_seq_len=MAX_SEQ_LEN, linear=linear).eval()
    expected = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in rebuilt.state_dict().items()} == expected
    assert [(n, type(m)) for n, m in rebuilt.named_modules()] == [(n, type(m)) for n, m in model.named_modules()]
    # Loaded as the recipes load it: the same function, bitwise (the same modules computing in the same order).
    fill_adapter_model(rebuilt, HFCheckpointer(str(base_dir), model_family=family), adapter_dir=adapter)
    with torch.no_grad():
        assert torch.equal(rebuilt(tokens()), model(tokens()))
    # The any_model configs' builder: the architecture from config.json, the adapters from adapter_config.json.
    from_folder = build_from_hf(path=base_dir, max_seq_len=MAX_SEQ_LEN, linear=linear)
    assert {k: v.shape for k, v in from_folder.state_dict().items()} == expected


@pytest.mark.interop
@pytest.mark.parametrize("family", FAMILIES)
def test_peft_loads_the_exported_adapter_onto_transformers(family: str, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    base, base_dir = save_base(family, tmp_path / "base")
    model = lora_model(family, base_dir, **all_targets(family))
    perturb_adapters(model)
    adapter = save_peft_adapter(model, tmp_path / "adapter", model_family=family, base_model_name_or_path=str(base_dir))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(hf_model, adapter).eval()
    with torch.no_grad():
        ours = model(tokens())
        assert (ours - base(tokens())).abs().max() > 1e-2  # the adapters matter
        # fp32, the same math in a different order (as in the family interop tests): 1e-4 on logits of ~1.
        torch.testing.assert_close(theirs(tokens()).logits, ours, atol=1e-4, rtol=0)
