"""float8 linear layers (torchao) and LoRA's frozen bases in float8: which layers convert, the refusal without a
float8 GPU, and training on the CPU, where torch emulates float8 matmuls (slowly, but with the same rounding): close
to bf16 on one process, and under ZeRO-3 the same whether FSDP2 gathers the weights in float8 or in float32. The
LoRA base's float8 matmuls are held to torchao's Float8Linear on the same weights, bit for bit."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.launch import run_workers
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3_demo, lora_llama3_demo
from toolkit.modules.peft import LoRALinear
from toolkit.data.collate import padded_collate
from toolkit.modules.peft.float8_base import float8_frozen_linear, to_float8
from toolkit.parallel import ParallelDims
from toolkit.training import FLOAT8_TOKEN_MULTIPLE, apply_float8, check_float8_device

sys.path.insert(0, str(Path(__file__).parent))
from _float8_worker import batches, demo_model, train  # noqa: E402


def float8_layers(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]


def test_every_decoder_projection_converts_but_not_the_output():
    with torch.device("meta"):
        model = llama3_demo(max_seq_len=64)
    keys = list(model.state_dict())
    converted = apply_float8(model, fsdp_float8_all_gather=False)
    projections = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.down_proj", "mlp.up_proj"]
    assert converted == float8_layers(model) == [f"layers.{i}.{p}" for i in range(4) for p in projections]
    assert type(model.output) is nn.Linear
    assert list(model.state_dict()) == keys  # checkpoints load unchanged


def test_lora_converts_the_plain_projections_and_runs_the_adapted_ones_bases_in_float8():
    with torch.device("meta"):
        model = lora_llama3_demo(max_seq_len=64, lora_attn_modules=["q_proj", "v_proj"], lora_rank=16, lora_alpha=32,
                                 apply_lora_to_output=True)
    keys = list(model.state_dict())
    converted = apply_float8(model, fsdp_float8_all_gather=False)
    projections = ["self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj", "mlp.up_proj"]
    assert float8_layers(model) == [f"layers.{i}.{p}" for i in range(4) for p in projections]
    bases = [name for name, module in model.named_modules() if getattr(module, "float8_base", False)]
    assert bases == [f"layers.{i}.self_attn.{p}" for i in range(4) for p in ("q_proj", "v_proj")]
    assert converted == sorted(bases + float8_layers(model), key=[n for n, _ in model.named_modules()].index)
    assert not model.output.float8_base  # the output projection stays in bf16, adapted or not
    assert list(model.state_dict()) == keys


def test_a_model_with_nothing_to_convert_is_refused():
    # QLoRA's NF4 bases on every projection: nothing left for float8.
    with torch.device("meta"):
        model = lora_llama3_demo(max_seq_len=64, lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 apply_lora_to_mlp=True, lora_rank=16, lora_alpha=32, quantize_base=True)
    with pytest.raises(UserError, match="no linear layer of this model can compute in float8"):
        apply_float8(model, fsdp_float8_all_gather=False)


def test_dora_bases_stay_in_full_precision():
    with torch.device("meta"):
        model = lora_llama3_demo(max_seq_len=64, lora_attn_modules=["q_proj"], lora_rank=16, lora_alpha=32,
                                 use_dora=True)
    apply_float8(model, fsdp_float8_all_gather=False)
    assert not any(getattr(module, "float8_base", False) for module in model.modules())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_base_in_float8_is_torchaos_float8_linear_bit_for_bit(dtype):
    # The same scaling recipe as torchao's default (one dynamic scale per tensor; e4m3 input and weight, e5m2 output
    # gradient): the same output and input gradient, exactly, as Float8Linear on the same weight. Both are 3-4% from
    # float64 here (e4m3 keeps 3 mantissa bits).
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 48, bias=False)).to(dtype).requires_grad_(False)
    weight = reference[0].weight.detach().clone()
    convert_to_float8_training(reference, module_filter_fn=lambda module, fqn: True)
    x = torch.randn(2, 5, 64, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 5, 48, dtype=dtype)
    expected = reference(x)
    expected.backward(grad)
    expected_grad, x.grad = x.grad, None
    out = float8_frozen_linear(x, weight)
    out.backward(grad)
    assert out.dtype == dtype and torch.equal(out, expected) and torch.equal(x.grad, expected_grad)
    exact = x.detach().double() @ weight.double().T
    assert 0 < float((out.detach().double() - exact).abs().max() / exact.abs().max()) < 0.08


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_scales_are_torchaos_bit_for_bit(dtype):
    # torchao divides the largest float8 value by the amax in float64 and rounds to float32; a float32 division
    # differs in the last bit for about a quarter of amaxes, and on a GPU that moved a quarter of a projection's
    # outputs by one bf16 step against Float8Linear. Over 400 tensors of assorted magnitudes every scale is equal
    # (the single-tensor test above happens to land on an amax where both divisions agree).
    from torchao.float8.float8_utils import amax_to_scale

    torch.manual_seed(0)
    largest = torch.finfo(dtype).max
    float32_division_differs = 0
    for magnitude in torch.logspace(-4, 4, 400):
        tensor = torch.randn(8, 16) * magnitude
        amax = tensor.abs().amax()
        _, inverse = to_float8(tensor, dtype)
        assert torch.equal(inverse, amax_to_scale(amax, dtype).reciprocal())
        float32_division_differs += bool(largest / amax != amax_to_scale(amax, dtype))
    assert float32_division_differs > 10  # the test can tell the two divisions apart


def test_float8_rows_are_padded_to_16_per_part():
    # A weight's gradient in float8 contracts over the tokens, which CUDA's float8 matmul wants a multiple of 16: the
    # recipes pad each row (each of its parts under sequence or context parallelism) to 16 positions.
    def dims(tp: int = 1, cp: int = 1) -> ParallelDims:
        return ParallelDims(strategy="zero3", dp_replicate=1, dp_shard=2 * cp, tp=tp, cp=cp)

    assert dims().row_multiple(sequence_parallel=False) == 1
    assert dims().row_multiple(sequence_parallel=False, part_multiple=FLOAT8_TOKEN_MULTIPLE) == 16
    assert dims(tp=2).row_multiple(sequence_parallel=False, part_multiple=16) == 16  # rows whole on each rank
    assert dims(tp=2).row_multiple(sequence_parallel=True) == 2
    assert dims(tp=2).row_multiple(sequence_parallel=True, part_multiple=16) == 32
    assert dims(cp=2).row_multiple(sequence_parallel=False, part_multiple=16) == 64  # 4 chunks of 16
    assert dims(tp=2, cp=2).row_multiple(sequence_parallel=True, part_multiple=16) == 64
    batch = [{"tokens": [1] * n, "labels": [1] * n} for n in (37, 5)]
    padded = padded_collate(batch, pad_id=0, pad_to_multiple_of=dims().row_multiple(sequence_parallel=False,
                                                                                    part_multiple=16))
    assert padded["tokens"].shape == (2, 48)


def test_a_lora_layer_with_a_float8_base_adds_its_adapter_and_bias():
    torch.manual_seed(0)
    layer = LoRALinear(32, 48, rank=4, alpha=8, use_bias=True)
    torch.nn.init.normal_(layer.lora_b.weight)
    x = torch.randn(3, 32, requires_grad=True)
    plain = layer(x)
    layer.float8_base = True
    float8 = layer(x)
    adapter = layer.lora_b(layer.lora_a(x) * layer.scale)
    torch.testing.assert_close(float8 - adapter - layer.bias, float8_frozen_linear(x, layer.weight))
    assert float((float8 - plain).abs().max() / plain.abs().max()) < 0.08
    float8.sum().backward()
    assert x.grad is not None and layer.lora_a.weight.grad is not None
    assert layer.weight.grad is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_refused_without_a_float8_gpu():
    with pytest.raises(UserError, match=r"compute capability 8\.9 or newer.*on the cpu; set float8=false") as error:
        check_float8_device(torch.device("cpu"))
    assert "\n" not in str(error.value)


def test_float8_trains_like_bf16():
    # e4m3 keeps 3 mantissa bits of activations and weights (relative rounding up to 2^-4), e5m2 2 bits of output
    # gradients (2^-3); with one scale per tensor the errors average out over each dot product, and over 6 steps the
    # loss stays within 0.13% of bf16's here (bf16 itself rounds to 2^-8). 1% leaves room for other CPUs' kernels.
    steps = batches(6)
    bf16 = train(demo_model(float8=False, dtype=torch.bfloat16), steps)
    float8 = train(demo_model(float8=True, dtype=torch.bfloat16), steps)
    assert bf16[-1] < bf16[0] - 1  # it learns
    torch.testing.assert_close(float8, bf16, rtol=0.01, atol=0)


def test_lora_with_float8_bases_trains_like_bf16():
    # Adapters on every projection, their bases in float8: as close to bf16 as the plain model (0.04% here). Rank-8
    # adapters on a random base learn slowly: 0.17 nats in 6 steps.
    steps = batches(6)
    bf16 = train(demo_model(float8=False, dtype=torch.bfloat16, lora=True), steps)
    float8 = train(demo_model(float8=True, dtype=torch.bfloat16, lora=True), steps)
    assert bf16[-1] < bf16[0] - 0.1  # it learns
    assert float8 != bf16  # the bases did run in float8
    torch.testing.assert_close(float8, bf16, rtol=0.01, atol=0)


def test_zero3_gathers_float8_weights_exactly(tmp_path):
    # Cast per shard with the amax of the whole weight (one all-reduce), the float8 bytes gathered are those a cast
    # of the gathered float32 weight gives: the same training, bitwise, in a quarter of the all-gather bytes. And
    # LoRA's float8 bases train under ZeRO-3 as on one process.
    result = run_workers(Path(__file__).parent / "_float8_worker.py", str(tmp_path / "result.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "result.json").read_text())
    assert runs["float8_all_gather_weight"] == "WeightWithDynamicFloat8CastTensor"
    assert runs["float8_all_gather"] == runs["float32_all_gather"]
    # LoRA's float8 bases, sharded: as on one process, to the float8 rounding of activations scaled per process
    # (measured 2.1e-4 apart; a backward that used a freed, zeroed weight was 2% off at step 2).
    one_process = train(demo_model(float8=True, dtype=torch.float32, lora=True), batches(3))
    torch.testing.assert_close(runs["lora_float8_zero3"], one_process, rtol=2e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU of compute capability 8.9 or newer")
def test_a_frozen_base_in_float8_on_cuda_is_torchaos_and_compiles():
    # CUDA's _scaled_mm wants its second operand column-major (the CPU's takes any layout): a Llama 3.1 8B MLP
    # projection's shapes, eager against torchao's Float8Linear, then compiled, as a recipe runs it.
    from torchao.float8 import convert_to_float8_training

    torch.manual_seed(0)
    device, dtype = torch.device("cuda"), torch.bfloat16
    reference = nn.Sequential(nn.Linear(4096, 14336, bias=False)).to(device, dtype).requires_grad_(False)
    weight = reference[0].weight.detach().clone()
    convert_to_float8_training(reference, module_filter_fn=lambda module, fqn: True)
    x = torch.randn(2, 1024, 4096, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 1024, 14336, device=device, dtype=dtype)
    expected = reference(x)
    expected.backward(grad)
    expected_grad, x.grad = x.grad, None
    out = float8_frozen_linear(x, weight)
    out.backward(grad)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=0)
    eager_grad, x.grad = x.grad, None
    compiled = torch.compile(float8_frozen_linear)(x, weight)
    compiled.backward(grad)
    # Compiled, the casts fuse and may round the scaled values differently in the last bit of float32.
    torch.testing.assert_close(compiled, out, rtol=0.02, atol=0.02 * float(out.detach().abs().max()))
    torch.testing.assert_close(x.grad, eager_grad, rtol=0.02, atol=0.02 * float(eager_grad.abs().max()))
