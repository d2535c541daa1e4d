"""DoRA: magnitude initialization, exact identity at initialization, merging, and gradients against PEFT."""

import pytest
import torch
from torch import nn

from toolkit.models.llama3 import llama3, lora_llama3
from toolkit.modules.peft import DoRALinear, get_adapter_params, get_merged_state_dict, init_adapters
from toolkit.training import materialize

DIMS = dict(
    vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64,
    rope_base=10_000.0,
)


def dora_model() -> tuple[nn.Module, nn.Module]:
    """(DoRA model, its base): built on meta, materialized, base loaded, adapters initialized."""
    torch.manual_seed(0)
    base = llama3(**DIMS).eval()
    with torch.device("meta"):
        model = lora_llama3(
            **DIMS, lora_attn_modules=["q_proj", "v_proj", "o_proj"], apply_lora_to_mlp=True,
            apply_lora_to_output=True, lora_rank=4, lora_alpha=8.0, use_dora=True,
        )
    materialize(model, device=torch.device("cpu"))
    model.load_state_dict(base.state_dict(), strict=False)
    init_adapters(model)
    return model.eval(), base


def test_magnitude_starts_at_the_row_norms_of_the_loaded_base():
    model, base = dora_model()
    q = model.layers[0].self_attn.q_proj
    expected = torch.linalg.vector_norm(base.layers[0].self_attn.q_proj.weight, dim=1)
    torch.testing.assert_close(q.magnitude, expected, atol=0, rtol=0)
    assert "layers.0.self_attn.q_proj.magnitude" in get_adapter_params(model)


def test_dora_at_init_is_the_base_exactly():
    torch.manual_seed(0)
    layer = DoRALinear(16, 24, rank=4, alpha=8.0, use_bias=True)
    base = nn.Linear(16, 24)
    base.load_state_dict({"weight": layer.weight, "bias": layer.bias})
    x = torch.randn(3, 16)
    assert torch.equal(layer(x), base(x))  # m / ||W|| is exactly 1 and B = 0

    model, base = dora_model()
    tokens = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))


def test_dora_merged_equals_unmerged():
    model, _ = dora_model()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in get_adapter_params(model).values():
            param.add_(0.1 * torch.randn(param.shape, generator=gen))  # magnitudes stay near the norms
        tokens = torch.randint(0, 97, (2, 12), generator=gen)
        unmerged = model(tokens)
        plain = llama3(**DIMS).eval()
        plain.load_state_dict(get_merged_state_dict(model))
        merged = plain(tokens)
    # fp32 rounding only, as for LoRA (see test_lora.py): m/||V|| (W x + s B A x) against (m V/||V||) x.
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)


@pytest.mark.interop
def test_dora_forward_and_gradients_match_peft():
    """One layer against PEFT's DoRA on the same weights, in training mode: outputs and the gradients of A, B
    and the magnitude (PEFT, like us, treats the norm as a constant; Liu et al., 2024, section 4.3)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    ours = DoRALinear(16, 24, rank=4, alpha=8.0)
    with torch.no_grad():
        ours.lora_b.weight.normal_(0, 0.1)
        ours.magnitude.add_(0.1)
    host = nn.Sequential()
    host.add_module("proj", nn.Linear(16, 24, bias=False))
    host = peft.inject_adapter_in_model(
        peft.LoraConfig(r=4, lora_alpha=8.0, target_modules=["proj"], use_dora=True, init_lora_weights=False), host
    )
    theirs = host.proj
    with torch.no_grad():
        theirs.base_layer.weight.copy_(ours.weight)
        theirs.lora_A["default"].weight.copy_(ours.lora_a.weight)
        theirs.lora_B["default"].weight.copy_(ours.lora_b.weight)
        theirs.lora_magnitude_vector["default"].weight.copy_(ours.magnitude)
    x = torch.randn(5, 16)
    y_ours, y_theirs = ours.train()(x), host.train()(x)
    torch.testing.assert_close(y_ours, y_theirs, atol=1e-6, rtol=0)
    (y_ours * torch.arange(24.0)).sum().backward()
    (y_theirs * torch.arange(24.0)).sum().backward()
    for mine, peft_param in [
        (ours.lora_a.weight, theirs.lora_A["default"].weight),
        (ours.lora_b.weight, theirs.lora_B["default"].weight),
        (ours.magnitude, theirs.lora_magnitude_vector["default"].weight),
    ]:
        torch.testing.assert_close(mine.grad, peft_param.grad, atol=1e-5, rtol=1e-5)
