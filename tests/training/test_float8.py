"""float8 linear layers (torchao): which layers convert, the refusal without a float8 GPU, and training on the CPU,
where torch emulates float8 matmuls (slowly, but with the same rounding): close to bf16 on one process, and under
ZeRO-3 the same whether FSDP2 gathers the weights in float8 or in float32."""

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.launch import run_workers
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3_demo, lora_llama3_demo
from toolkit.training import apply_float8, check_float8_device

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


def test_lora_converts_only_the_projections_without_adapters():
    with torch.device("meta"):
        model = lora_llama3_demo(max_seq_len=64, lora_attn_modules=["q_proj", "v_proj"], lora_rank=16, lora_alpha=32)
    apply_float8(model, fsdp_float8_all_gather=False)
    projections = ["self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj", "mlp.up_proj"]
    assert float8_layers(model) == [f"layers.{i}.{p}" for i in range(4) for p in projections]


def test_a_model_with_nothing_to_convert_is_refused():
    with torch.device("meta"):
        model = lora_llama3_demo(max_seq_len=64, lora_attn_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 apply_lora_to_mlp=True, lora_rank=16, lora_alpha=32)
    with pytest.raises(UserError, match="no linear layer of this model can compute in float8"):
        apply_float8(model, fsdp_float8_all_gather=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_refused_without_a_float8_gpu():
    with pytest.raises(UserError, match=r"compute capability 8\.9 or newer.*on the cpu; set float8=false") as error:
        check_float8_device(torch.device("cpu"))
    assert "\n" not in str(error.value)


def test_float8_trains_like_bf16():
    # e4m3 keeps 3 mantissa bits of activations and weights (relative rounding up to 2^-4), e5m2 2 bits of output
    # gradients (2^-3); with one scale per tensor the errors average out over each dot product, and over 6 steps the
    # loss stays within 0.15% of bf16's here (bf16 itself rounds to 2^-8). 1% leaves room for other CPUs' kernels.
    steps = batches(6)
    bf16 = train(demo_model(float8=False, dtype=torch.bfloat16), steps)
    float8 = train(demo_model(float8=True, dtype=torch.bfloat16), steps)
    assert bf16[-1] < bf16[0] - 1  # it learns
    torch.testing.assert_close(float8, bf16, rtol=0.01, atol=0)


def test_zero3_gathers_float8_weights_exactly(tmp_path):
    # Cast per shard with the amax of the whole weight (one all-reduce), the float8 bytes gathered are those a cast
    # of the gathered float32 weight gives: the same training, bitwise, in a quarter of the all-gather bytes.
    result = run_workers(Path(__file__).parent / "_float8_worker.py", str(tmp_path / "result.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "result.json").read_text())
    assert runs["float8_all_gather_weight"] == "WeightWithDynamicFloat8CastTensor"
    assert runs["float8_all_gather"] == runs["float32_all_gather"]
