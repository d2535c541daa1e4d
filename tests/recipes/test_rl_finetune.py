"""The RL recipe end to end on the demo (fp32, CPU, gloo), shortened: 4 steps of G=4 completions for 4 prompts.

Layout-invariant RL: the completions sampled are the same token for token, and the rewards, losses (1e-5) and
final weights (1e-5) equal, on 1 process, 2 processes (ddp, zero1, zero2, zero3, hsdp) and tensor parallel 2, for full fine-tuning,
LoRA, DoRA and QLoRA, with a KL reference (grpo), with DAPO's dynamic sampling, and for a mixture of experts with
routing replay. (Float rounding differs between layouts, by
1e-7 in the logits, so a draw within that distance of a boundary of the cumulative distribution could pick another
token; the draws are fixed by seed, and these runs have none.) Exact resume: a run killed after step 3 and resumed
from its step-2 checkpoint samples the same completions and ends with the same weights as the uninterrupted one.
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune, run_tune_here

FAST = [
    "max_steps=4", "num_generations=4", "batch_size=4", "micro_batch_size=2", "dataset.num_samples=64",
    "validation_dataset.num_samples=8", "sft_warmup_steps=0", "progress_bar=false", "save_every_n_steps=2",
    "eval_every_n_steps=null", "save_rollouts=true", "max_new_tokens=8",
    # From random weights no answer is right: a format reward (a letter a-m anywhere) makes the rewards of a group
    # differ, so that the steps train.
    "rewards=[{_component_: toolkit.rl.ExactMatch}, {_component_: toolkit.rl.FormatReward, pattern: '[a-m]', "
    "mode: search, weight: 0.5}]",
]
WARM = ["sft_warmup_steps=10", "sft_warmup_batch_size=8"]  # the demo's supervised warm-up, shortened
LORA = [
    "model._component_=toolkit.models.llama3.lora_llama3_demo", "model.lora_attn_modules=[q_proj,v_proj]",
    "model.lora_rank=8", "model.lora_alpha=16", "model.apply_lora_to_mlp=true",
]
# A tiny Qwen3-MoE from random weights, its updates replaying the experts of the old log-probabilities' pass.
MOE = [
    "model._component_=toolkit.models.qwen3_moe.qwen3_moe", "model.vocab_size=384", "model.num_layers=2",
    "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16", "model.embed_dim=64",
    "model.moe_intermediate_dim=32", "model.num_experts=4", "model.num_experts_per_tok=2",
    "checkpointer.model_family=qwen3_moe", "routing_replay=true", "updates_per_rollout=2",
]
VARIANTS = {
    "full": [],
    "warm": WARM,
    "lora": LORA,
    "dora": [*LORA, "model.use_dora=true"],
    "qlora": [*LORA, "model.quantize_base=true"],
    "full_kl": ["kl_coef=0.05"],
    "dapo": ["loss=dapo", "dynamic_sampling=true", "max_refills=2", "overlong_filter=true"],
    "moe_replay": MOE,
}
TWO_PROCESS_RUNS = {
    "full_ddp": ("full", ["data_parallel=ddp"]),
    "full_zero3": ("full", ["data_parallel=zero3"]),
    "full_tp2": ("full", ["tensor_parallel=2"]),
    "full_zero1": ("full", ["data_parallel=zero1"]),
    "full_zero2": ("full", ["data_parallel=zero2"]),
    "full_hsdp": ("full", ["data_parallel=hsdp", "hsdp_shard_size=1"]),  # 2 replicas of 1 shard
    "lora_ddp": ("lora", ["data_parallel=ddp"]),
    "lora_zero3": ("lora", ["data_parallel=zero3"]),
    "dora_ddp": ("dora", ["data_parallel=ddp"]),
    "qlora_zero3": ("qlora", ["data_parallel=zero3"]),
    "full_kl_zero3": ("full_kl", ["data_parallel=zero3"]),
    "dapo_ddp": ("dapo", ["data_parallel=ddp"]),
    "moe_replay_zero3": ("moe_replay", ["data_parallel=zero3"]),
}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps(out: Path) -> list[dict]:
    return [r for r in records(out) if "reward_mean" in r]


def rollouts(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    final = out / "final"
    files = sorted(final.glob("*.safetensors")) or sorted(final.glob("adapter/*.safetensors"))  # (LoRA: the adapter)
    assert files, f"nothing saved in {final}"
    return {k: v for f in files for k, v in load_file(f).items()}


def run_here(out: Path, *overrides: str) -> subprocess.CompletedProcess:
    result = run_tune_here("run", "rl_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST,
                           *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rl_single")
    for name, extra in VARIANTS.items():
        run_here(root / name, *extra)
    return {name: root / name for name in VARIANTS}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rl_two")
    runs = {name: RecipeRun("rl_finetune", root / name, *FAST, *VARIANTS[variant], *extra)
            for name, (variant, extra) in TWO_PROCESS_RUNS.items()}
    result = run_recipes(list(runs.values()), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: r.output_dir for name, r in runs.items()}


def assert_same_run(a: Path, b: Path, *, tol: float = 1e-5) -> None:
    ra, rb = rollouts(a), rollouts(b)
    assert [(r["step"], r["prompt_index"], r["sample"], r["tokens"]) for r in ra] == \
        [(r["step"], r["prompt_index"], r["sample"], r["tokens"]) for r in rb]
    assert [r["reward"] for r in ra] == [r["reward"] for r in rb]
    sa, sb = steps(a), steps(b)
    assert len(sa) == len(sb) == 4
    for x, y in zip(sa, sb):
        for key in ("loss", "reward_mean", "reward_std", "accuracy", "completion_len_mean", "clip_fraction", "kl",
                    "entropy", "equal_reward_groups"):
            assert x[key] == pytest.approx(y[key], rel=tol, abs=tol), key
        assert x["num_tokens"] == y["num_tokens"]
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=tol, rtol=tol, msg=key)


@pytest.mark.parametrize("name", list(TWO_PROCESS_RUNS))
def test_every_layout_samples_the_same_completions_and_trains_the_same_weights(single, two_processes, name):
    assert_same_run(single[TWO_PROCESS_RUNS[name][0]], two_processes[name])


def test_each_step_records_the_rollouts_metrics(single):
    for name, out in single.items():
        records_ = steps(out)
        for r in records_:
            for key in ("reward_mean", "reward_std", "reward_exact_match", "accuracy", "completion_len_mean",
                        "completion_len_max", "truncated_share", "clip_fraction", "kl", "entropy",
                        "equal_reward_groups", "generation_tokens_per_second", "training_tokens_per_second"):
                assert key in r, (name, key)
            assert 0 <= r["accuracy"] <= 1
            assert r["reward_mean"] == pytest.approx(r["reward_exact_match"] + 0.5 * r["reward_format_reward"])
            assert r["completion_len_max"] <= 8
        lines = rollouts(out)
        # Every step's 4 prompts x 4 samples (DAPO's refills train more groups but record the sampled batch).
        assert [r["step"] for r in lines] == [s for s in range(1, 5) for _ in range(16)]
        assert all(1 <= len(r["tokens"]) <= 8 for r in lines)
        for step in range(1, 5):  # the group's mean reward over its samples is the step's figure
            mean = sum(r["reward"] for r in lines if r["step"] == step) / 16
            assert mean == pytest.approx(records_[step - 1]["reward_mean"])
    assert steps(single["full_kl"])[1]["kl"] > 0  # the policy moved from its reference
    # Routing replay: the second update's router, moved by the first, would choose other experts for some tokens.
    agreements = [r["routing_agreement"] for r in steps(single["moe_replay"])]
    assert all(0 < a <= 1 for a in agreements) and min(agreements) < 1
    assert steps(single["full"])[1]["kl"] == 0
    stdout = (single["full"] / "metrics.jsonl").read_text()
    assert "val_accuracy" in stdout and (single["warm"] / "sft_warmup" / "config.json").is_file()
    assert sum(r["grad_norm"] > 0 for r in steps(single["full"])) >= 3  # the steps train


def test_a_run_killed_mid_way_resumes_with_the_same_completions_and_weights(single, tmp_path):
    out = tmp_path / "killed"
    killed = run_tune("run", "rl_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST, *WARM,
                      env={"TUNE_INJECT_FAULT": "after_step:3"})
    assert killed.returncode != 0
    assert (out / "checkpoints" / "step_2").is_dir() and not (out / "final").exists()
    resumed = run_tune("run", "rl_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST, *WARM,
                       "resume_from=auto", env={"TUNE_INJECT_FAULT": ""})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 2" in resumed.stdout
    assert "supervised warm-up" not in resumed.stdout  # the step checkpoint holds the warmed-up, trained weights
    assert rollouts(out) == rollouts(single["warm"])
    wa, wb = weights(single["warm"]), weights(out)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_a_prompt_longer_than_the_context_left_is_named_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    result = run_tune_here("run", "rl_finetune_single_device", "--config", "demo", f"output_dir={out}", *FAST,
                           "max_seq_len=20", "max_new_tokens=12")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "dataset: demo train row" in lines[0] and "max_seq_len - max_new_tokens" in lines[0]
    assert not out.exists()
