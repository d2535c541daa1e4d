"""Profiler window and model FLOPs per token (the MFU numerator)."""

import json

import pytest
import torch

from toolkit.models.llama3 import llama3, lora_llama3
from toolkit.modules.peft import get_adapter_params, set_trainable_params
from toolkit.errors import UserError
from toolkit.training import StepProfiler, flops_per_token, profiler_settings, step_metrics
from toolkit.training.step import StepResult

DIMS = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64)


def test_full_model_flops_are_6n_plus_attention():
    with torch.device("meta"):
        model = llama3(**DIMS)
    # Matmul weights per layer: q 32x32, k and v 16x32 (2 kv heads of 8), o 32x32, gate/up/down 64x32: 10240;
    # the output projection 96x32; the input embedding is a lookup.
    n = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32) + 96 * 32
    attention = 2 * 12 * 4 * 8 * 64  # layers x 12 x heads x head_dim x seq_len
    assert flops_per_token(model, seq_len=64) == 6 * n + attention


def test_lora_counts_the_frozen_base_at_4_and_adapters_at_6():
    with torch.device("meta"):
        model = lora_llama3(lora_attn_modules=["q_proj"], lora_rank=2, lora_alpha=4, **DIMS)
    set_trainable_params(model, get_adapter_params(model))
    base = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32) + 96 * 32
    adapters = 2 * (2 * 32 + 32 * 2)  # A (2x32) and B (32x2) per layer's q_proj
    attention = 2 * 12 * 4 * 8 * 16
    assert flops_per_token(model, seq_len=16) == 4 * base + 6 * adapters + attention


def test_tied_output_counts_the_embedding_once():
    with torch.device("meta"):
        model = llama3(**DIMS, tie_word_embeddings=True)
    n = 2 * (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32) + 96 * 32
    assert flops_per_token(model, seq_len=1) == 6 * n + 2 * 12 * 4 * 8


def test_mfu_is_positions_per_second_times_flops_over_peak():
    result = StepResult(loss=1.0, num_tokens=100, num_positions=1000)
    metrics = step_metrics(step=1, epoch=0, result=result, lr=0.1, grad_norm=1.0, elapsed_s=2.0,
                           device=torch.device("cpu"), gather_rank_stats=False, flops_per_token=6e6, peak_flops=1e12)
    assert metrics["mfu"] == pytest.approx(500 * 6e6 / 1e12)
    assert "mfu" not in step_metrics(step=1, epoch=0, result=result, lr=0.1, grad_norm=1.0, elapsed_s=2.0,
                                     device=torch.device("cpu"), gather_rank_stats=False)


def _steps(profiler: StepProfiler, n: int, device: str = "cpu") -> None:
    x = torch.randn(64, 64, device=device, requires_grad=True)
    for _ in range(n):
        (x @ x).sum().backward()
        profiler.step()
    profiler.close()


def test_profiler_writes_a_trace_of_the_window(tmp_path):
    profiler = StepProfiler(tmp_path, rank=0, enabled=True, wait_steps=1, warmup_steps=1, active_steps=2)
    _steps(profiler, 6)
    folder = tmp_path / "profile" / "rank_0"
    trace = json.loads((folder / "trace.json").read_text())
    assert any("mm" in event.get("name", "") for event in trace["traceEvents"])
    assert "aten::mm" in (folder / "summary.txt").read_text()
    assert not (folder / "summary_device.txt").exists()  # no GPU time to sort by


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiler_on_a_gpu_sorts_the_kernels_by_gpu_time(tmp_path):
    profiler = StepProfiler(tmp_path, rank=0, enabled=True, wait_steps=1, warmup_steps=1, active_steps=2)
    _steps(profiler, 6, device="cuda")
    folder = tmp_path / "profile" / "rank_0"
    table = (folder / "summary_device.txt").read_text()
    assert "aten::mm" in table and "Self CUDA" in table, table
    assert (folder / "memory_snapshot.pickle").stat().st_size > 0


@pytest.mark.parametrize("kwargs", [dict(enabled=False), dict(enabled=True, ranks=[1])])
def test_profiler_off_or_other_rank_writes_nothing(tmp_path, kwargs):
    _steps(StepProfiler(tmp_path, rank=0, **kwargs), 6)
    assert not (tmp_path / "profile").exists()



def test_profiler_settings_accept_its_options_and_name_a_misspelled_one():
    options = dict(enabled=True, wait_steps=1, warmup_steps=0, active_steps=2, ranks=[0, 1], record_shapes=True,
                   with_stack=False)
    assert profiler_settings(options) == options
    assert profiler_settings(None) == {}
    with pytest.raises(UserError, match=r"profiler.activ_steps: .*did you mean 'active_steps'"):
        profiler_settings(dict(enabled=True, activ_steps=2))
    with pytest.raises(UserError, match="profiler.rank: "):  # the recipe's own argument, not an option
        profiler_settings(dict(rank=1))
    with pytest.raises(UserError, match="expected a section"):
        profiler_settings(True)

def _load_compare_benchmark():
    """benchmarks/compare.py as a module (it imports nothing heavy at the top)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("compare_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_benchmarks_count_is_the_recipes_without_attention(method):
    # benchmarks/compare.py counts issue 8's FLOPs from a shape's dimensions (its main process imports no torch);
    # the recipes count them from the model's parameters. Without the attention term (seq_len=0) the two must agree
    # on every benchmarked shape, LoRA configured as the benchmark configures ours.
    compare = _load_compare_benchmark()
    for name, shape in compare.SHAPES.items():
        dims = compare._our_dims(shape, 64)
        with torch.device("meta"):
            if method == "full":
                model = llama3(**dims)
            else:
                model = lora_llama3(**dims, lora_attn_modules=list(compare.LORA_MODULES), apply_lora_to_mlp=True,
                                    lora_rank=compare.LORA_RANK, lora_alpha=compare.LORA_ALPHA)
                set_trainable_params(model, get_adapter_params(model))
        assert flops_per_token(model, seq_len=0) == compare.matmul_flops_per_token(shape, method), name
