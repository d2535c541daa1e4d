"""LoRA layers and the LoRA Llama builders: exact identity at initialization, merging, trainable parameters."""

from pathlib import Path

import pytest
import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.models.llama3 import llama3, lora_llama3, lora_llama3_1_8b, qlora_llama3_1_70b
from toolkit.modules.peft import (
    LoRALinear,
    disable_adapters,
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_state_dict,
    init_adapters,
    is_adapter_key,
    merge_lora_weights,
    set_trainable_params,
    training_method,
)
from toolkit.training import HFCheckpointer, materialize

DIMS = dict(
    vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64,
    rope_base=10_000.0,
)
LORA = dict(
    lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True, apply_lora_to_output=True
)


def lora_model(**overrides) -> nn.Module:
    """A tiny LoRA Llama built the recipe way: meta device, materialized, base loaded by the checkpointer from
    a saved plain model (seed 0), adapters initialized."""
    kwargs = dict(DIMS, **LORA, lora_rank=4, lora_alpha=8.0, **overrides)
    with torch.device("meta"):
        model = lora_llama3(**kwargs)
    materialize(model, device=torch.device("cpu"))
    model.load_state_dict(base_model().state_dict(), strict=False)
    init_adapters(model)
    return model


def base_model() -> nn.Module:
    torch.manual_seed(0)
    model = llama3(**DIMS)
    with torch.no_grad():  # norms away from one, so a skipped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


def randomize_adapters(model: nn.Module, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.copy_(0.1 * torch.randn(param.shape, generator=gen))


def tokens() -> torch.Tensor:
    return torch.randint(0, DIMS["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))


def test_lora_linear_at_init_is_the_base_exactly():
    torch.manual_seed(0)
    base = nn.Linear(16, 24, bias=True)
    lora = LoRALinear(16, 24, rank=4, alpha=8.0, use_bias=True)
    lora.load_state_dict(base.state_dict(), strict=False)
    x = torch.randn(3, 5, 16)
    assert lora.lora_b.weight.abs().sum() == 0 and lora.lora_a.weight.abs().sum() > 0
    assert torch.equal(lora(x), base(x))  # B = 0 adds exact zeros


def test_lora_model_at_init_is_the_base_exactly(tmp_path: Path):
    base = base_model().eval()
    HFCheckpointer(None, model_family="llama3").save(base, tmp_path / "base")
    with torch.device("meta"):
        model = lora_llama3(**DIMS, **LORA, lora_rank=4, lora_alpha=8.0)
    materialize(model, device=torch.device("cpu"))
    checkpointer = HFCheckpointer(str(tmp_path / "base"), model_family="llama3")
    with pytest.raises(UserError, match="lora_a"):  # adapters are not in a base checkpoint...
        checkpointer.load(model)
    checkpointer.load(model, ignore_missing=is_adapter_key)  # ...which the recipe says
    init_adapters(model)
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens()), base(tokens()))


def test_state_dict_keys_extend_the_plain_models():
    plain = set(llama3(**DIMS).state_dict())
    keys = set(lora_model().state_dict())
    assert {k for k in keys if not is_adapter_key(k)} == plain
    adapters = get_adapter_state_dict(lora_model().state_dict())
    assert "layers.0.self_attn.q_proj.lora_a.weight" in adapters
    assert "layers.1.mlp.down_proj.lora_b.weight" in adapters
    assert "output.lora_a.weight" in adapters
    assert len(adapters) == 2 * (2 * 7 + 1)
    assert adapters["layers.0.self_attn.k_proj.lora_b.weight"].shape == (16, 4)  # [out, rank]: 2 kv heads x 8


def test_merged_equals_unmerged():
    model = lora_model().eval()
    randomize_adapters(model)
    x = tokens()
    with torch.no_grad():
        unmerged = model(x)
        plain = llama3(**DIMS).eval()
        plain.load_state_dict(get_merged_state_dict(model))  # strict: exactly the plain model's keys
        merged = plain(x)
        in_place = merge_lora_weights(model)(x)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    # fp32: x W^T + s (x A^T) B^T and x (W + s B A)^T differ only in rounding. Each of the ~10 chained matmuls
    # (inner size <= 64, |logits| ~ 1) rounds at ~1e-7 relative; 1e-5 absolute leaves a wide margin and would
    # still catch a wrong scale or transposition (those change logits by ~1e-2 here).
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)
    torch.testing.assert_close(in_place, merged, atol=0, rtol=0)
    assert (unmerged - base_model()(x)).abs().max() > 1e-2  # the adapters do change the output


def test_only_adapters_are_trainable():
    model = lora_model(lora_dropout=0.1).train()
    adapters = get_adapter_params(model)
    set_trainable_params(model, adapters)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(adapters)
    model(tokens()).square().mean().backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == (name in adapters), name
    # At initialization B = 0, so A gets no gradient while B does (Hu et al., 2021, section 4.1).
    q = model.layers[0].self_attn.q_proj
    assert q.lora_a.weight.grad.abs().max() == 0 and q.lora_b.weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match="not parameters"):
        set_trainable_params(model, ["layers.0.self_attn.q_proj.lora_c.weight"])


def test_disable_adapters_gives_the_base():
    model = lora_model().eval()
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(tokens())
        with disable_adapters(model):
            assert torch.equal(model(tokens()), base_model()(tokens()))
        assert torch.equal(model(tokens()), adapted)


def test_builder_arguments_are_checked():
    with pytest.raises(UserError, match="unknown"):
        lora_llama3(**DIMS, lora_attn_modules=["qkv_proj"], lora_rank=4, lora_alpha=8)
    with pytest.raises(UserError, match="ties"):
        lora_llama3(**dict(DIMS, tie_word_embeddings=True), **LORA, lora_rank=4, lora_alpha=8)
    with pytest.raises(UserError, match="no adapters"):
        lora_llama3(**DIMS, lora_attn_modules=[], lora_rank=4, lora_alpha=8)


def test_public_sizes_build_on_meta():
    with torch.device("meta"):
        lora = lora_llama3_1_8b(lora_attn_modules=["q_proj", "v_proj"], lora_rank=8)
        qlora = qlora_llama3_1_70b(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True)
    adapter = sum(p.numel() for p in get_adapter_params(lora).values())
    # Rank 8 on q (4096 -> 4096) and v (4096 -> 1024) in 32 layers: 32 * 8 * (4096 + 4096 + 4096 + 1024).
    assert adapter == 32 * 8 * (4096 + 4096 + 4096 + 1024)
    base = sum(p.numel() for n, p in lora.named_parameters() if not is_adapter_key(n))
    assert abs(base / 1e9 - 8.030) < 0.001
    assert type(qlora.layers[0].mlp.up_proj.weight).__name__ == "NF4Tensor"


def test_training_method_names_what_a_step_checkpoint_of_the_model_holds():
    # Recorded in every step checkpoint: a checkpoint resumes only under the method that wrote it.
    with torch.device("meta"):
        models = {
            "full": llama3(**DIMS),
            "lora": lora_llama3(**DIMS, **LORA, lora_rank=4),
            "dora": lora_llama3(**DIMS, **LORA, lora_rank=4, use_dora=True),
            "qlora": lora_llama3(**DIMS, lora_attn_modules=["q_proj"], lora_rank=4, quantize_base=True),
        }
    assert {method: training_method(model) for method, model in models.items()} == {m: m for m in models}
