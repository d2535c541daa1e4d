"""The distill recipe end to end: a briefly trained demo Llama taught to a smaller student (full) or to LoRA
adapters, the same losses on 1 and 2 processes (ddp, zero3: the teacher sharded like the student), a run killed
mid-way resumed bitwise, the student's held-out divergence from the teacher falling, bad input refused in one line.

Tolerances: on 2 processes the sums are rounded in another order, hence rtol 1e-5 on the losses, as the SFT parity
tests; resumes are bitwise."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune, run_tune_here

FAST = [
    "max_steps=5", "dataset.num_samples=256", "validation_dataset.num_samples=24", "~eval_tasks", "batch_size=8",
    "micro_batch_size=2", "progress_bar=false", "save_every_n_steps=2", "eval_every_n_steps=null",
]
LORA = [
    "model._component_=toolkit.models.llama3.lora_llama3_demo", "model.lora_attn_modules=[q_proj,v_proj]",
    "model.lora_rank=8", "model.lora_alpha=16", "~model.vocab_size", "~model.num_layers", "~model.num_heads",
    "~model.num_kv_heads", "~model.embed_dim", "~model.intermediate_dim", "~model.rope_base",
]
VARIANTS = {"full": [], "lora": LORA, "jsd": ["kd_loss=jsd", "jsd_beta=0.3", "temperature=2.0"]}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps(out: Path) -> list[dict]:
    return [r for r in records(out) if "kd_loss" in r]


def tune_here(*args: str):
    result = run_tune_here(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The demo Llama after a few SFT steps, in Hugging Face format."""
    out = tmp_path_factory.mktemp("teacher")
    tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={out}", "max_steps=20",
              "dataset.num_samples=640", "~eval_tasks", "~validation_dataset", "progress_bar=false",
              "save_every_n_steps=null")
    return out / "final"


def distill_args(out: Path, teacher: Path, *extra: str) -> list[str]:
    return ["run", "distill_single_device", "--config", "demo", f"output_dir={out}",
            f"teacher_checkpointer.checkpoint_dir={teacher}", *FAST, *extra]


@pytest.fixture(scope="module")
def single(teacher, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill_single")
    for name, extra in VARIANTS.items():
        tune_here(*distill_args(root / name, teacher, *extra))
    return {name: root / name for name in VARIANTS}


TWO_PROCESS_RUNS = {
    "full_ddp": ("full", ["data_parallel=ddp"]),
    "full_zero3": ("full", ["data_parallel=zero3"]),
    "lora_zero3": ("lora", ["data_parallel=zero3"]),
    "jsd_zero2": ("jsd", ["data_parallel=zero2"]),
    # Both models split over the vocabulary: the divergence reduced over the TP group.
    "full_tp2": ("full", ["tensor_parallel=2"]),
    "lora_tp2": ("lora", ["tensor_parallel=2"]),
    "jsd_tp2_sequence_parallel": ("jsd", ["tensor_parallel=2", "sequence_parallel=true"]),
}


@pytest.fixture(scope="module")
def two_processes(teacher, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill_two")
    runs = {name: RecipeRun("distill", root / name, f"teacher_checkpointer.checkpoint_dir={teacher}", *FAST,
                            *VARIANTS[variant], *extra)
            for name, (variant, extra) in TWO_PROCESS_RUNS.items()}
    result = run_recipes(list(runs.values()), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: r.output_dir for name, r in runs.items()}


@pytest.mark.parametrize("name", list(TWO_PROCESS_RUNS))
def test_two_processes_train_as_one(name, single, two_processes):
    a, b = steps(two_processes[name]), steps(single[TWO_PROCESS_RUNS[name][0]])
    assert len(a) == len(b) == 5
    for x, y in zip(a, b):
        for key in ("loss", "ce_loss", "kd_loss"):
            assert x[key] == pytest.approx(y[key], rel=1e-5), key
        assert x["num_tokens"] == y["num_tokens"]


def test_the_loss_mixes_the_cross_entropy_and_the_divergence(single):
    for record in steps(single["full"]):  # kd_ratio 0.5
        assert record["loss"] == pytest.approx(0.5 * record["ce_loss"] + 0.5 * record["kd_loss"], rel=1e-6)


def test_the_student_moves_toward_its_teacher(single):
    for name in ("full", "jsd"):
        held_out = [r for r in records(single[name]) if "val_kd_loss" in r]
        assert [r["step"] for r in held_out] == [0, 5]
        assert held_out[1]["val_kd_loss"] < held_out[0]["val_kd_loss"]
    assert (single["full"] / "final" / "model.safetensors").is_file()
    assert (single["lora"] / "final" / "adapter" / "adapter_config.json").is_file()


def test_sigkill_then_resume_is_bitwise_exact(single, teacher, tmp_path):
    out = tmp_path / "run"
    killed = run_tune(*distill_args(out, teacher), env={"TUNE_INJECT_FAULT": "after_step:3"})
    assert killed.returncode != 0 and not (out / "final").exists()
    resumed = tune_here(*distill_args(out, teacher, "resume_from=auto"))
    assert "resumed at step 2" in resumed.stdout
    # The summary: the student is no model the shipped generate config builds, so a copy of it comes first.
    lines = resumed.stdout.splitlines()
    done = next(line for line in lines if line.startswith("done: "))
    assert re.match(r"done: 5 steps in \dm\d\ds \(this attempt, resumed from step_2\)", done), done
    assert "next: tune cp generate/demo my_generate.yaml   # then set its model and tokenizer to this run's" in lines
    assert f"      tune run generate --config my_generate.yaml checkpointer.checkpoint_dir={out / 'final'}" in lines
    assert [r["loss"] for r in steps(out)] == [r["loss"] for r in steps(single["full"])]
    a, b = load_file(out / "final" / "model.safetensors"), load_file(single["full"] / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("override", "message"), [
    ("teacher_model.vocab_size=256",
     "tune: error: teacher_model: its vocabulary has 256 tokens and the student's 384; distillation compares their "
     "distributions token by token, so both need the same tokenizer"),
    ("teacher_checkpointer.checkpoint_dir=null",
     "tune: error: teacher_checkpointer.checkpoint_dir: a teacher needs its trained weights; give its folder"),
    # The checkpointer's own check, named by the key of the node it was built from (not the student's).
    ("teacher_checkpointer.checkpoint_dir={tmp}/gone",
     "tune: error: teacher_checkpointer.checkpoint_dir: {tmp}/gone is not a folder"),
])
def test_a_teacher_that_cannot_teach_is_refused_in_one_line(override, message, teacher, tmp_path):
    out = tmp_path / "run"
    result = run_tune_here(*distill_args(out, teacher, override.format(tmp=tmp_path)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [message.format(tmp=tmp_path)]
    assert not out.exists()
