"""NF4 base weights (QLoRA, Dettmers et al., 2023): round-trip error within the format's bound, the meta-device
fast path, materialization, checkpoint loading into NF4, and QLoRA forward/backward."""

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from toolkit.models.llama3 import llama3, lora_llama3, qlora_llama3_demo
from toolkit.modules.peft import (
    NF4Linear,
    dequantize,
    get_adapter_params,
    init_adapters,
    is_adapter_key,
    is_nf4,
    set_trainable_params,
    to_nf4,
)
from toolkit.training import HFCheckpointer, materialize

DIMS = dict(
    vocab_size=97, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128, max_seq_len=64,
    rope_base=10_000.0,
)


def test_round_trip_error_is_within_the_format_bound():
    """Each value is stored as ``level[i] * scale`` for the 64-value block's absmax ``s``. Rounding to the nearest
    level costs at most ``s * g / 2`` with ``g`` the largest gap between adjacent levels; the scale itself is
    stored after double quantization (its mean subtracted, the rest as int8 with step ``2 a / 256`` for the
    group's largest deviation ``a``, clamped at 127), off by at most one step, which moves a value by at most
    ``|level| * step <= step``."""
    torch.manual_seed(0)
    weight = torch.randn(256, 512) * torch.logspace(-2, 0, 512)  # blocks of very different scales
    weight[3, :64] = 0.0  # an all-zero block
    nf4 = to_nf4(weight)
    error = (dequantize(nf4) - weight).abs().view(-1, 64)  # [blocks, 64]

    levels = nf4.nf4.sort().values
    max_half_gap = (levels[1:] - levels[:-1]).max() / 2
    scales = weight.view(-1, 64).abs().amax(dim=1)  # [blocks]
    deviations = (scales - scales.mean()).view(-1, nf4.scaler_block_size).abs().amax(dim=1)
    scale_step = (2 * deviations / 256).repeat_interleave(nf4.scaler_block_size)  # [blocks]
    bound = scales * max_half_gap + scale_step + 1e-6  # plus float rounding
    assert (error <= bound[:, None]).all()
    assert 0.15 < max_half_gap < 0.16  # NF4's widest gap is between -1 and -0.696
    # The bound is not vacuous: the typical error is well inside it.
    assert error.mean() < 0.25 * bound.mean()


def test_weights_whose_size_is_not_a_multiple_of_the_block_are_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        to_nf4(torch.randn(3, 7))


def test_meta_fast_path_has_the_layout_of_a_real_quantization():
    weight = torch.randn(96, 128)
    real = to_nf4(weight)
    meta = to_nf4(weight.to("meta"))
    names, ctx = real.__tensor_flatten__()
    meta_names, meta_ctx = meta.__tensor_flatten__()
    assert names == meta_names and meta.shape == real.shape and meta.dtype == real.dtype
    for name in names:
        a, b = getattr(real, name), getattr(meta, name)
        assert (a.shape, a.dtype, b.device.type) == (b.shape, b.dtype, "meta"), name
    ctx.pop("tensor_meta"), meta_ctx.pop("tensor_meta")
    assert ctx == meta_ctx


def test_materialize_keeps_nf4_and_loading_quantizes():
    source = torch.randn(32, 64)
    with torch.device("meta"):
        layer = NF4Linear(64, 32)
    materialize(layer, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert is_nf4(layer.weight) and layer.weight.dtype == torch.bfloat16 and not layer.weight.requires_grad
    names, _ = layer.weight.__tensor_flatten__()
    assert all(getattr(layer.weight, n).device.type == "cpu" for n in names)
    layer.state_dict()["weight"].copy_(source.bfloat16())  # what HFCheckpointer.load does
    torch.testing.assert_close(dequantize(layer.weight), dequantize(to_nf4(source.bfloat16())), atol=0, rtol=0)
    layer.float()
    assert is_nf4(layer.weight) and dequantize(layer.weight).dtype == torch.float32


def qlora_and_dense_lora(tmp_path: Path) -> tuple[nn.Module, nn.Module]:
    """(QLoRA model loaded from a checkpoint by HFCheckpointer, the same LoRA model with the dequantized base in
    full precision), with equal nonzero adapters."""
    torch.manual_seed(0)
    HFCheckpointer(None, model_family="llama3").save(llama3(**DIMS), tmp_path / "base")
    args = dict(DIMS, lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True, lora_rank=4, lora_alpha=8.0)
    with torch.device("meta"):
        qlora = lora_llama3(**args, quantize_base=True)
        dense = lora_llama3(**args)
    materialize(qlora, device=torch.device("cpu"))
    HFCheckpointer(str(tmp_path / "base"), model_family="llama3").load(qlora, ignore_missing=is_adapter_key)
    init_adapters(qlora)
    with torch.no_grad():
        for param in get_adapter_params(qlora).values():
            param.normal_(0, 0.05)
    materialize(dense, device=torch.device("cpu"))
    dense.load_state_dict({key: dequantize(value) for key, value in qlora.state_dict().items()})
    return qlora, dense


def test_qlora_forward_and_backward_equal_lora_on_the_dequantized_base(tmp_path: Path):
    qlora, dense = qlora_and_dense_lora(tmp_path)
    assert is_nf4(qlora.layers[0].self_attn.q_proj.weight) and is_nf4(qlora.layers[0].self_attn.k_proj.weight)
    assert not is_nf4(qlora.output.weight)  # the unadapted output projection keeps the model dtype
    tokens = torch.randint(0, 97, (2, 12))
    for model in (qlora, dense):
        set_trainable_params(model, get_adapter_params(model))
        model(tokens).logsumexp(-1).mean().backward()
    # The NF4 layer dequantizes and then runs the same linear as the dense model: equal up to rounding.
    torch.testing.assert_close(qlora(tokens), dense(tokens), atol=1e-5, rtol=0)
    for name, param in get_adapter_params(qlora).items():
        torch.testing.assert_close(param.grad, dense.get_parameter(name).grad, atol=1e-5, rtol=1e-4)


def test_qlora_trains():
    torch.manual_seed(0)
    model = qlora_llama3_demo(lora_attn_modules=["q_proj", "v_proj"], lora_rank=4, vocab_size=64, max_seq_len=32)
    params = get_adapter_params(model)
    set_trainable_params(model, params)
    optimizer = torch.optim.AdamW(params.values(), lr=1e-2)
    tokens = torch.randint(0, 64, (4, 16))
    losses = []
    for _ in range(8):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_torchao_is_first_imported_outside_the_meta_device():
    # The first NF4 weight is usually quantized while a model is built under torch.device("meta"). torchao 0.10
    # builds tables at import and reads one back (.tolist()), which fails on the meta device: the QLoRA run of the
    # first GPU measurement stopped there. In a fresh interpreter, record the default device torchao is imported
    # under when the first quantization happens inside a meta-device block.
    code = """
import sys, torch
seen = []
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torchao":
            seen.append(str(torch.get_default_device()))
        return None
sys.meta_path.insert(0, Spy())
from toolkit.modules.peft import nf4
with torch.device("meta"):
    weight = nf4.to_nf4(torch.empty(64, 128, dtype=torch.bfloat16))
assert nf4.is_nf4(weight) and weight.device.type == "meta", weight
print(seen)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['cpu']", result.stdout


def test_torchao_before_0_11_keeps_nf4_in_dtypes(monkeypatch):
    # torchao 0.10 (the version torchtune 0.6.1 pins, and so what a benchmark machine may bring) has no
    # torchao.quantization.to_nf4; its NF4Tensor and to_nf4 live in torchao.dtypes.
    from toolkit.modules.peft import nf4

    old_quantization = types.ModuleType("torchao.quantization")
    dtypes = types.ModuleType("torchao.dtypes")
    dtypes.to_nf4, dtypes.NF4Tensor = object(), type("NF4Tensor", (), {})
    package = types.ModuleType("torchao")
    package.quantization, package.dtypes = old_quantization, dtypes
    monkeypatch.setitem(sys.modules, "torchao", package)
    monkeypatch.setitem(sys.modules, "torchao.quantization", old_quantization)
    monkeypatch.setitem(sys.modules, "torchao.dtypes", dtypes)
    monkeypatch.setattr(nf4, "_torchao", None)
    assert nf4._torchao_quantization() is dtypes
