"""Optimizer techniques in the recipes, end to end on the CPU demo (fp32, deterministic):

- ``optimizer_in_backward``: the same AdamW arithmetic per parameter, run from FSDP2's (or autograd's) hook instead
  of after backward, so losses and weights equal the ordinary step's bitwise, on one process and under every
  strategy it supports; its step checkpoints resume exactly and are those of the ordinary step.
- fused AdamW, the recipes' default for torch's Adam and AdamW: the same steps as torch's per-parameter loop, on
  FSDP2's shards too.
- ``torchao.optim.AdamW8bit``: its quantized state, sharded by ZeRO-3, survives a step checkpoint exactly.
- ``float8``: refused, in one line, without a GPU of compute capability 8.9 or newer; trains like bf16 on one
  (full fine-tuning, and LoRA with its bases in float8).

The runs reuse tests/recipes/test_resume.py's launchers: a global batch of 8, 8 steps, a checkpoint every 3 steps.
The uninterrupted 2-process runs share one launch (``two_process_runs``); 1-process runs go through `tune run` in
the test's own process.
"""

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from toolkit.training import fused_by_default

from test_resume import (
    assert_bitwise_equal, assert_same_run, losses, run, run_here, run_together, together, weights,
)
from tests.launch import run_tune_here

IN_BACKWARD = ["optimizer_in_backward=true", "clip_grad_norm=null"]
# 2 processes x 4 sequences: one micro-batch per step, as the step inside backward needs.
ZERO3 = ["data_parallel=zero3", "micro_batch_size=4"]
LORA = ["save_merged=false", *ZERO3]


def train_here(output_dir: Path, *overrides: str, **kwargs) -> Path:
    result = run_here(output_dir, *overrides, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


def layout(strategy: str) -> list[str]:
    # HSDP with shard groups of 1 process replicates over the two: its hooks run after the all-reduce as well.
    return [f"data_parallel={strategy}", "micro_batch_size=4", "hsdp_shard_size=1"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict[str, Path]:
    """Every 2-process run of this file but the 8-bit AdamW's, by name, their output folders: ``in_backward_zero3``
    (its checkpoints at steps 3, 6 and 8 are resumed from), killed after step 7 in a launch of its own and then
    resumed (``in_backward_zero3_resumed``), and the others in one launch with that resume."""
    root = tmp_path_factory.mktemp("two_processes")
    killed = run(root / "in_backward_zero3_resumed", *ZERO3, *IN_BACKWARD, fault="after_step:7:1")
    assert killed.returncode != 0
    in_backward_zero3 = root / "in_backward_zero3"
    runs = {
        "in_backward_zero3": together(in_backward_zero3, *ZERO3, *IN_BACKWARD),
        "in_backward_zero3_resumed": together(
            root / "in_backward_zero3_resumed", *ZERO3, *IN_BACKWARD, "resume_from=auto"
        ),
        # The ordinary step resumed from the step inside backward's checkpoint.
        "ordinary_from_in_backward_step_3": together(
            root / "ordinary_from_in_backward_step_3", *ZERO3, "clip_grad_norm=null",
            f"resume_from={in_backward_zero3 / 'checkpoints' / 'step_3'}",
        ),
        **{f"ordinary_{strategy}": together(root / f"ordinary_{strategy}", *layout(strategy), "clip_grad_norm=null")
           for strategy in ("zero2", "zero3", "hsdp")},
        **{f"in_backward_{strategy}": together(root / f"in_backward_{strategy}", *layout(strategy), *IN_BACKWARD)
           for strategy in ("zero2", "hsdp")},
        "lora_ordinary": together(root / "lora_ordinary", *LORA, "clip_grad_norm=null", recipe="lora_finetune"),
        "lora_in_backward": together(root / "lora_in_backward", *LORA, *IN_BACKWARD, recipe="lora_finetune"),
        "fused": together(root / "fused", *ZERO3),
        "loop": together(root / "loop", *ZERO3, "optimizer.fused=false"),
        "fp16": together(root / "fp16", "data_parallel=zero3", "dtype=fp16-mixed", "save_every_n_steps=null"),
        "fp32": together(root / "fp32", "data_parallel=zero3", "save_every_n_steps=null"),
    }
    run_together(*runs.values())
    paths = {name: r.output_dir for name, r in runs.items()}
    paths["in_backward_zero3_resumed_stdout"] = runs["in_backward_zero3_resumed"].stdout_file
    return paths


# --- the step inside backward ------------------------------------------------------------------------------------


def test_in_backward_equals_the_ordinary_step_on_one_process(tmp_path):
    ordinary = train_here(tmp_path / "ordinary", "clip_grad_norm=null", "micro_batch_size=8")
    in_backward = train_here(tmp_path / "in_backward", *IN_BACKWARD, "micro_batch_size=8")
    assert_same_run(in_backward, ordinary)


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "hsdp"])
def test_in_backward_equals_the_ordinary_step_on_two_processes(strategy, two_process_runs):
    # layout(strategy), with and without the step inside backward; zero3's is in_backward_zero3 (ZERO3).
    assert_same_run(two_process_runs[f"in_backward_{strategy}"], two_process_runs[f"ordinary_{strategy}"])


def test_in_backward_resumes_exactly(two_process_runs):
    # Killed after step 7 on rank 1, then resumed with resume_from=auto (see two_process_runs).
    assert "resumed at step 6" in two_process_runs["in_backward_zero3_resumed_stdout"].read_text()
    assert_same_run(two_process_runs["in_backward_zero3_resumed"], two_process_runs["in_backward_zero3"])


def test_in_backward_checkpoints_are_the_ordinary_steps(two_process_runs):
    # Saved by parameter name, the per-parameter optimizers' state is one AdamW's: the ordinary step resumes from it.
    in_backward_zero3 = two_process_runs["in_backward_zero3"]
    resumed = two_process_runs["ordinary_from_in_backward_step_3"]
    assert losses(resumed) == losses(in_backward_zero3)[3:]
    assert_bitwise_equal(load_file(resumed / "final" / "model.safetensors"),
                         load_file(in_backward_zero3 / "final" / "model.safetensors"))


def test_lora_in_backward_under_zero3(two_process_runs):
    # Only the adapters have optimizers and hooks; the frozen, sharded base gets neither.
    def adapter(out: Path) -> dict[str, torch.Tensor]:
        return load_file(out / "final" / "adapter" / "adapter_model.safetensors")

    ordinary, in_backward = two_process_runs["lora_ordinary"], two_process_runs["lora_in_backward"]
    assert losses(in_backward) == losses(ordinary)
    assert_bitwise_equal(adapter(in_backward), adapter(ordinary))


def test_in_backward_refuses_gradient_clipping_in_one_line(tmp_path):
    result = run_here(tmp_path, "optimizer_in_backward=true", "micro_batch_size=8")  # the demo clips at 1.0
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "set clip_grad_norm=null or optimizer_in_backward=false" in result.stderr


# --- fused AdamW, the recipes' default ----------------------------------------------------------------------------


def test_fused_adamw_is_the_default_and_only_adds_the_switch():
    adamw = OmegaConf.create({"_component_": "torch.optim.AdamW", "lr": 1e-3})
    assert fused_by_default(adamw) == {**adamw, "fused": True} and "fused" not in adamw
    for kept in ({"_component_": "torch.optim.AdamW", "fused": False},
                 {"_component_": "torch.optim.Adam", "foreach": True},
                 {"_component_": "torchao.optim.AdamW8bit"}, {"_component_": "torch.optim.SGD", "lr": 0.1}):
        assert fused_by_default(OmegaConf.create(kept)) == kept


def test_fused_adamw_steps_like_torchs_loop_on_fsdp2_shards(two_process_runs):
    # The recipes' default (fused: one kernel over the DTensor shards) against torch's per-parameter loop: the same
    # arithmetic in another order, so equal to float32 rounding, which Adam's division by sqrt(v) can amplify where
    # v is near zero. Measured after 8 steps: 7 of the 885,888 weights differ by more than 1e-7, one by 6.5e-6,
    # against updates of up to lr = 3e-3 per step; the losses are equal.
    fused, loop = two_process_runs["fused"], two_process_runs["loop"]  # ZERO3, and ZERO3 with optimizer.fused=false
    assert losses(fused) == pytest.approx(losses(loop), rel=1e-6)
    fused_weights, loop_weights = weights(fused), weights(loop)
    assert fused_weights.keys() == loop_weights.keys()
    for key, value in fused_weights.items():
        torch.testing.assert_close(value, loop_weights[key], rtol=0, atol=3e-5)



def test_fp16_mixed_under_zero3_trains_like_fp32_with_the_default_optimizer(two_process_runs):
    # The default (fused AdamW) used to fail at the first step under FSDP2's fp16 loss scaler (its overflow flag
    # has another shape than the fused kernel takes): it is now left unfused there. The demo's first steps do not
    # overflow at the default scale, so fp16 only rounds (measured: at most 2.4e-5 from fp32's losses over 8 steps).
    # Both under zero3 without step checkpoints; fp16 with dtype=fp16-mixed.
    fp16, fp32 = two_process_runs["fp16"], two_process_runs["fp32"]
    assert losses(fp16) != losses(fp32)  # fp16 did compute
    assert losses(fp16) == pytest.approx(losses(fp32), rel=2e-4)

# --- torchao's 8-bit AdamW ---------------------------------------------------------------------------------------


@pytest.mark.slow  # torchao compiles its step per parameter shape: about a minute with a cold compile cache
def test_adamw8bit_under_zero3_resumes_exactly(tmp_path):
    # The state is torchao's OptimState8bit inside FSDP2's DTensors; a step checkpoint stores it dequantized and
    # loading quantizes it again, to the same codes and scales: the resumed run is the uninterrupted one, bitwise.
    adamw8bit = ["optimizer._component_=torchao.optim.AdamW8bit", *ZERO3]
    killed = run(tmp_path / "run", *adamw8bit, fault="after_step:7:1")
    assert killed.returncode != 0
    # The uninterrupted run and the killed one's resume_from=auto resume, in one launch.
    resumed = together(tmp_path / "run", *adamw8bit, "resume_from=auto")
    run_together(together(tmp_path / "reference", *adamw8bit), resumed)
    reference = tmp_path / "reference"
    assert losses(reference)[-1] < losses(reference)[0] - 0.5
    assert "resumed at step 6" in resumed.stdout()
    assert_same_run(tmp_path / "run", reference)


# --- float8 ------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_float8_without_a_float8_gpu_is_a_one_line_error(tmp_path):
    result = run_tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}",
                           "float8=true")
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "float8: needs an NVIDIA GPU of compute capability 8.9 or newer" in result.stderr
    assert "set float8=false" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU of compute capability 8.9 or newer",
)
@pytest.mark.parametrize("recipe", ["full_finetune", "lora_finetune"])
def test_float8_trains_like_bf16_on_a_gpu(tmp_path, recipe):
    # float8 (e4m3 forward, e5m2 gradients) rounds each matmul input to 3 (2) mantissa bits; on this short run the
    # losses stay within 2% of bf16's (measured on CPU emulation: within 0.3% over 10 steps). LoRA's demo adapts
    # every projection, so there float8 is its frozen bases' matmuls.
    common = ["dtype=bf16-mixed", "save_every_n_steps=null", "device=cuda"]
    bf16 = train_here(tmp_path / "bf16", *common, recipe=recipe)
    float8 = train_here(tmp_path / "float8", *common, "float8=true", recipe=recipe)
    torch.testing.assert_close(losses(float8), losses(bf16), rtol=0.02, atol=0)
