"""The full_finetune recipe end to end through `tune run`, on 1 and 2 CPU processes.

``single_run``, the 2-process run and the refused 2-process launch are `tune run` in new processes; the other runs
and refusals are the same command in the test's own process (``tune_here``: `tune run ..._single_device` runs the
recipe in its own process), which spares each an interpreter start and the imports."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import run_tune as tune
from tests.launch import run_tune_here as tune_here

# A few steps of the demo on a small slice of its data: seconds per run. Held-out evaluation is skipped
# (eval_tasks=null) except where a test needs it.
FAST = [
    "max_steps=4", "dataset.num_samples=256", "progress_bar=false", "~eval_tasks",
    "batch_size=8", "micro_batch_size=2",
]


def losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single")
    result = tune("run", "full_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST)
    assert result.returncode == 0, result.stderr
    return out


def test_single_device_writes_metrics_and_hf_checkpoint(single_run):
    records = [json.loads(line) for line in (single_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert {"step", "loss", "lr", "num_tokens", "tokens_per_second"} <= r.keys()
        assert r["num_tokens"] > 0 and r["loss"] > 0
    final = single_run / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 4
    weights = load_file(final / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "lm_head.weight" in weights


def test_two_processes_match_one_process(single_run, tmp_path):
    # Same global batch (8): 1 process x 4 micro-steps of 2 versus 2 processes x 2 micro-steps of 2. The loss
    # is normalized by the global token count, so both runs compute the same gradients up to float rounding.
    result = tune(
        "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "demo", f"output_dir={tmp_path}", *FAST
    )
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(losses(tmp_path), losses(single_run), rtol=1e-5, atol=1e-6)
    ours = load_file(tmp_path / "final" / "model.safetensors")
    reference = load_file(single_run / "final" / "model.safetensors")
    for key in reference:
        # Adam divides by sqrt(v): float-rounding differences in the gradient sum become ~1e-6 relative steps.
        torch.testing.assert_close(ours[key], reference[key], rtol=1e-4, atol=1e-5)


def test_same_seed_reproduces_exactly(single_run, tmp_path):
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}", *FAST)
    assert result.returncode == 0, result.stderr
    assert losses(tmp_path) == losses(single_run)


def test_activation_memory_switches_change_no_loss(single_run, tmp_path):
    # Checkpointing every 2nd layer recomputes the same kernels on the same values, and on the CPU offloading is
    # a logged no-op (its hooks are checked on the CPU target in tests/training/test_activations.py): the same
    # losses to the bit.
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}", *FAST,
                       "activation_checkpointing=2", "activation_offloading=true")
    assert result.returncode == 0, result.stderr
    assert "activation_offloading: training runs on the CPU" in result.stderr
    assert losses(tmp_path) == losses(single_run)


def test_a_bad_activation_checkpointing_value_is_one_line(tmp_path):
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}", *FAST,
                       "activation_checkpointing=0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith(
        "activation_checkpointing: expects true or false or an integer >= 1, got 0"
    )


def test_generate_answers_from_the_checkpoint(single_run):
    result = tune_here("run", "generate", "--config", "demo", f"checkpointer.checkpoint_dir={single_run / 'final'}",
                       "prompt=reverse: abcd", "max_new_tokens=5")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip("\n")) <= 5 * 4  # at most 5 tokens (bytes) of output, plus nothing else
    # One vocabulary: generate reads checkpointer.checkpoint_dir like every recipe. The top-level key it once read
    # is told the new one, and a bad folder is named by the key it was given as.
    for override, refusal in [
        (f"checkpoint_dir={single_run / 'final'}", (
            f"tune: error: override 'checkpoint_dir={single_run / 'final'}': checkpoint_dir: moved: this recipe reads "
            "it as checkpointer.checkpoint_dir now; set checkpointer.checkpoint_dir instead")),
        (f"checkpointer.checkpoint_dir={single_run / 'gone'}",
         f"tune: error: checkpointer.checkpoint_dir: {single_run / 'gone'} is not a folder"),
    ]:
        result = tune_here("run", "generate", "--config", "demo", override)
        assert result.returncode == 2 and result.stderr.strip().splitlines() == [refusal], result.stderr


def test_refuses_to_overwrite_a_finished_run(single_run):
    before = (single_run / "metrics.jsonl").read_text()
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={single_run}", *FAST)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "overwrite=true" in result.stderr
    assert (single_run / "metrics.jsonl").read_text() == before



def test_a_misspelled_profiler_option_stops_before_overwriting(single_run):
    # `overwrite=true` would clear the finished run; the typo must stop the run first, in one line.
    before = (single_run / "metrics.jsonl").read_text()
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={single_run}", *FAST,
                       "overwrite=true", "profiler.enabeld=true")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "profiler.enabeld" in result.stderr and "did you mean 'enabled'" in result.stderr
    assert (single_run / "metrics.jsonl").read_text() == before


def test_bad_data_stops_an_overwriting_run_before_it_clears_the_old_one(single_run):
    # The data is built after the output folder is checked: `overwrite=true` must clear the old run only once
    # everything that can fail on the user's input (model, checkpoint, tokenizer, data) is built.
    before = sorted(p.relative_to(single_run) for p in single_run.rglob("*"))
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={single_run}", *FAST,
                       "overwrite=true", "dataset.num_samples=-1")
    assert result.returncode == 2, result.stderr
    assert "num_samples must be >= 0" in result.stderr
    assert sorted(p.relative_to(single_run) for p in single_run.rglob("*")) == before

def test_batch_size_that_does_not_divide_is_one_line_error(tmp_path):
    result = tune(
        "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "demo",
        f"output_dir={tmp_path}", *FAST, "batch_size=6", "micro_batch_size=2",
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "batch_size: 6 is not divisible" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_config_typo_is_caught_before_launch(tmp_path):
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}",
                       "model.max_seq_lne=32")
    assert result.returncode == 2
    assert "max_seq_lne" in result.stderr and "did you mean 'max_seq_len'" in result.stderr


def test_profiler_window_writes_a_trace(tmp_path):
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}", *FAST,
                       "profiler.enabled=true", "profiler.wait_steps=1", "profiler.warmup_steps=1",
                       "profiler.active_steps=2", "save_every_n_steps=null")
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "profile" / "rank_0"
    assert (folder / "trace.json").stat().st_size > 0 and "aten::" in (folder / "summary.txt").read_text()


@pytest.mark.slow
def test_compile_and_chunked_loss_train_like_the_plain_step(single_run, tmp_path):
    # torch.compile per layer (inductor, CPU) and the loss over 4 sequence chunks: the same math in another order.
    result = tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}", *FAST,
                       "compile=true", "loss_chunks=4")
    assert result.returncode == 0, result.stderr
    torch.testing.assert_close(losses(tmp_path), losses(single_run), rtol=1e-5, atol=0)
