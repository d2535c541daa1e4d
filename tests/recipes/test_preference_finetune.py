"""The preference_finetune recipe end to end, on the demo's synthetic pairs: DPO with each kind of reference (a
frozen copy of a full fine-tune, the LoRA base with its adapters off, log-probabilities precomputed once) gives the
same losses on 1 and 2 processes under ddp, zero3 and tp=2; a precomputed reference trains exactly as the live one;
a run killed mid-way and resumed ends bitwise equal to an uninterrupted one; bad input is refused in one line. KTO
on the demo's unpaired answers (config demo_kto) likewise.

The 1-process runs go through `tune run` in the test's own process; the 2-process runs share one launch.
Tolerances: on 2 processes the sums are rounded in another order (and the precomputed reference is scored in other
batches, so with other padding), hence rtol 1e-5 on the losses, as the SFT parity tests; resumes are bitwise.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune, run_tune_here
from toolkit.objectives import kto
from toolkit.objectives.preference import METRICS

FAST = [
    "max_steps=5", "dataset.num_samples=128", "validation_dataset.num_samples=24", "~eval_tasks", "batch_size=8",
    "micro_batch_size=2", "progress_bar=false", "save_every_n_steps=2", "eval_every_n_steps=null",
]
LORA = [
    "model._component_=toolkit.models.llama3.lora_llama3_demo", "model.lora_attn_modules=[q_proj,v_proj]",
    "model.lora_rank=8", "model.lora_alpha=16", "model.apply_lora_to_mlp=true",
]
PRECOMPUTED = ["precompute_reference=true"]
VARIANTS = {"full": [], "full_precomputed": PRECOMPUTED, "lora": LORA, "lora_precomputed": LORA + PRECOMPUTED,
            "kto_full": [], "kto_lora": LORA, "kto_lora_precomputed": LORA + PRECOMPUTED}
CONFIGS = {name: "demo_kto" if name.startswith("kto") else "demo" for name in VARIANTS}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps(out: Path) -> list[dict]:
    return [r for r in records(out) if "reward_accuracy" in r or "kl" in r]


def run_here(out: Path, *overrides: str, config: str = "demo"):
    result = run_tune_here("run", "preference_finetune_single_device", "--config", config, f"output_dir={out}",
                           *FAST, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference_single")
    for name, extra in VARIANTS.items():
        run_here(root / name, *extra, config=CONFIGS[name])
    return {name: root / name for name in VARIANTS}


TWO_PROCESS_RUNS = {
    "full_ddp": ("full", ["data_parallel=ddp"]),
    "full_zero3": ("full", ["data_parallel=zero3"]),
    "full_tp2": ("full", ["tensor_parallel=2"]),
    "full_precomputed_zero3": ("full_precomputed", ["data_parallel=zero3"]),
    "lora_ddp": ("lora", ["data_parallel=ddp"]),
    "lora_zero3": ("lora", ["data_parallel=zero3"]),
    "lora_tp2": ("lora", ["tensor_parallel=2"]),
    "lora_precomputed_ddp": ("lora_precomputed", ["data_parallel=ddp"]),
    "lora_precomputed_zero3": ("lora_precomputed", ["data_parallel=zero3"]),
    "lora_precomputed_tp2": ("lora_precomputed", ["tensor_parallel=2"]),
    "kto_full_zero3": ("kto_full", ["data_parallel=zero3"]),
    "kto_lora_ddp": ("kto_lora", ["data_parallel=ddp"]),
    "kto_lora_tp2": ("kto_lora", ["tensor_parallel=2"]),
    "kto_lora_precomputed_zero3": ("kto_lora_precomputed", ["data_parallel=zero3"]),
}


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("preference_two")
    runs = {name: RecipeRun("preference_finetune", root / name, *FAST, *VARIANTS[variant], *extra,
                            config=CONFIGS[variant])
            for name, (variant, extra) in TWO_PROCESS_RUNS.items()}
    result = run_recipes(list(runs.values()), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {name: r.output_dir for name, r in runs.items()}


def assert_same_training(a: Path, b: Path, *, rtol: float = 1e-5) -> None:
    sa, sb = steps(a), steps(b)
    assert len(sa) == len(sb) == 5
    for x, y in zip(sa, sb):
        assert x["loss"] == pytest.approx(y["loss"], rel=rtol, abs=1e-6)
        assert x["num_tokens"] == y["num_tokens"]
        if "kl" in x:  # kto: answers of each kind, and its metrics where the batch has both kinds
            assert x["desirable"] == y["desirable"] and x["desirable"] + x["undesirable"] == 8
            names = [name for name in kto.METRICS if name in x]
        else:
            assert x["pairs"] == y["pairs"] == 8
            names = METRICS
        for name in names:
            if name == "reward_accuracy" and max(abs(x["reward_margin"]), abs(y["reward_margin"])) < 1e-6:
                continue  # the policy is its reference (step 1): each pair's margin is float rounding, its sign noise
            assert x[name] == pytest.approx(y[name], rel=rtol, abs=1e-5), name


def test_every_step_records_the_preference_metrics(single):
    for out in (out for name, out in single.items() if not name.startswith("kto")):
        for record in steps(out):
            assert set(METRICS) <= set(record)
            assert record["reward_margin"] == pytest.approx(
                record["rewards_chosen"] - record["rewards_rejected"], abs=1e-6)  # float32 rewards
        first = steps(out)[0]  # the policy is still its reference: no margin, loss log 2
        # (No margin up to float32 rounding: the reference's log-probabilities come from other forwards, and MKL's
        # matmuls on some CPUs depend on the memory alignment of their operands: 4.8e-8 measured on an AMD EPYC, where
        # such a margin also decides some pairs' accuracy, so the first step's is not checked.)
        assert first["reward_margin"] == pytest.approx(0, abs=1e-6)
        assert first["loss"] == pytest.approx(0.6931472, abs=1e-6)


def test_every_kto_step_records_its_metrics_and_starts_at_its_reference(single):
    for name in ("kto_full", "kto_lora", "kto_lora_precomputed"):
        records_ = steps(single[name])
        for record in records_:
            assert {"kl", "desirable", "undesirable"} <= set(record) and record["kl"] >= 0
            if record["desirable"] and record["undesirable"]:
                assert set(kto.METRICS) <= set(record)
                assert record["reward_margin"] == pytest.approx(
                    record["rewards_desirable"] - record["rewards_undesirable"], abs=1e-6)
        # The policy is still its reference: r = z0 = 0, so every answer's loss is 1 - sigmoid(0) = 1/2.
        first = records_[0]
        # (0 up to float32 rounding, as for the pairs above.)
        assert first["kl"] == pytest.approx(0, abs=1e-6)
        assert first["rewards_desirable"] == pytest.approx(0, abs=1e-6)
        assert first["rewards_undesirable"] == pytest.approx(0, abs=1e-6)
        assert first["loss"] == pytest.approx(0.5, abs=1e-7)


@pytest.mark.parametrize("name", list(TWO_PROCESS_RUNS))
def test_two_processes_train_as_one(name, single, two_processes):
    assert_same_training(two_processes[name], single[TWO_PROCESS_RUNS[name][0]])


@pytest.mark.parametrize("kind", ["full", "lora", "kto_lora"])
def test_a_precomputed_reference_trains_as_the_live_one(kind, single):
    # Scored once before training in batches of other pairs (other padding), against each step's own forward.
    assert_same_training(single[f"{kind}_precomputed"], single[kind], rtol=1e-6)
    stored = load_file(single[f"{kind}_precomputed"] / "reference_logps.safetensors")
    assert stored["train"].shape == (128, 2) and stored["validation"].shape == (24, 2)  # kto: each answer and
    # its KL sequence; validation: pairs
    assert (stored["train"] < 0).all()


def test_a_precomputed_reference_is_kept_beside_the_cached_data_and_read_by_the_next_run(tmp_path):
    from toolkit.data.demo import TASKS, demo_tasks

    rows = [{"prompt": s["prompt"], "chosen": s["answer"], "rejected": TASKS["upper"](s["prompt"].split()[-1]) + "!"}
            for s in demo_tasks(num_samples=48)]
    source = tmp_path / "pairs.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cache = tmp_path / "cache"
    data = f"dataset={{_component_: toolkit.data.preference_dataset, source: {source}, cache_dir: {cache}}}"
    overrides = ["~validation_dataset", *LORA, *PRECOMPUTED, data]  # after FAST (run_here): the demo data replaced
    first = run_here(tmp_path / "first", *overrides)
    (kept,) = cache.glob("*/reference_logps-*.safetensors")  # in the folder of the tokenized pairs
    assert f"reference log-probabilities of the train pairs computed into {kept}" in first.stdout
    assert not (tmp_path / "first" / "reference_logps.safetensors").exists()
    assert load_file(kept)["train"].shape == (48, 2)
    # Another run on the same data from the same base (here another beta) reads it; another base would not.
    second = run_here(tmp_path / "second", *overrides, "beta=0.5")
    assert f"reference log-probabilities of the train pairs read from {kept}" in second.stdout
    other = run_here(tmp_path / "other", *overrides, "model.lora_rank=4")  # the fingerprint: the whole model config
    assert "train pairs computed into" in other.stdout and len(list(cache.glob("*/reference_logps-*"))) == 2


def test_the_results_are_a_hugging_face_model_or_a_peft_adapter(single):
    assert (single["full"] / "final" / "model.safetensors").is_file()
    config = json.loads((single["lora"] / "final" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and set(config["target_modules"]) >= {"q_proj", "v_proj"}


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    files = sorted((out / "final").rglob("*.safetensors"))
    return {f"{f.name}:{k}": v for f in files for k, v in load_file(f).items()}


@pytest.mark.parametrize("variant", ["full", "full_precomputed", "kto_full"])
def test_sigkill_then_resume_is_bitwise_exact(variant, single, tmp_path):
    out = tmp_path / variant
    killed = run_tune("run", "preference_finetune_single_device", "--config", CONFIGS[variant], f"output_dir={out}",
                      *FAST,
                      *VARIANTS[variant], env={"TUNE_INJECT_FAULT": "after_step:3"})
    assert killed.returncode != 0 and not (out / "final").exists()
    if variant == "full_precomputed":
        # A trained full fine-tune cannot recompute its reference: without the file, the resume is refused.
        broken = tmp_path / "broken"
        shutil.copytree(out, broken)
        (broken / "reference_logps.safetensors").unlink()
        refused = run_tune_here("run", "preference_finetune_single_device", "--config", "demo",
                                f"output_dir={broken}", *FAST, *VARIANTS[variant], "resume_from=auto")
        assert refused.returncode == 2 and "reference_logps.safetensors is missing" in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    resumed = run_here(out, *VARIANTS[variant], "resume_from=auto", config=CONFIGS[variant])
    assert "resumed at step 2" in resumed.stdout
    # The console's step lines show the rewards: DPO's accuracy and margin, KTO's margin and mean of each kind.
    trained = [line for line in resumed.stdout.splitlines() if line.startswith("step ") and "  loss " in line]
    shown = (("  margin ", "  r_desirable ", "  r_undesirable ") if variant == "kto_full"
             else ("  reward_acc ", "  margin "))
    assert trained and all(field in line for line in trained for field in shown), trained
    assert [r["loss"] for r in steps(out)] == [r["loss"] for r in steps(single[variant])]
    a, b = final_weights(out), final_weights(single[variant])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resuming_a_finished_run_past_its_steps_or_with_another_method(single, tmp_path):
    # The shared resume checks (recipe_setup.resume_point), as the full fine-tune has them (tests/recipes/
    # test_resume.py), on a LoRA DPO run: 5 steps, checkpoints at 2, 4 and 5, final/ written.
    out = tmp_path / "lora"
    shutil.copytree(single["lora"], out)
    files = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    complete = run_here(out, *LORA, "resume_from=auto")
    assert complete.stdout.strip().splitlines()[-1].startswith(
        f"{out}: the run is complete: its last step checkpoint, step_5, is at step 5 of 5 and final/ is written"
    )
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == files, "nothing changed"
    step_4 = out / "checkpoints" / "step_4"
    for overrides, refusal in [
        ([*LORA, "max_steps=3"], f"tune: error: resume_from: {step_4} is at step 4, past this run's last step, 3"),
        ([], (f"tune: error: {step_4 / 'trainer_state.json'}: written by the preference_finetune recipe (lora), but this "
              "run is the preference_finetune recipe (full): another method's checkpoint does not resume here")),
    ]:
        result = run_tune_here("run", "preference_finetune_single_device", "--config", "demo",
                               f"output_dir={tmp_path / 'new'}", *FAST, *overrides, f"resume_from={step_4}")
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith(refusal), result.stderr
    assert not (tmp_path / "new").exists()


def test_a_dataset_without_pairs_is_refused_in_one_line(tmp_path):
    out = tmp_path / "run"
    result = run_tune_here("run", "preference_finetune_single_device", "--config", "demo", f"output_dir={out}",
                           *FAST, "dataset._component_=toolkit.data.demo_dataset")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "tune: error: dataset: the dataset yields no chosen/rejected pairs; give a preference dataset such as "
        "toolkit.data.preference_dataset"
    ]
    assert not out.exists()


@pytest.mark.parametrize("override,message", [
    ("dataset._component_=toolkit.data.demo_preference_dataset",
     "tune: error: dataset: the dataset yields no answers labelled desirable or not; give a KTO dataset such as "
     "toolkit.data.kto_dataset"),
    ("validation_dataset._component_=toolkit.data.demo_unpaired_dataset",
     "tune: error: validation_dataset: the dataset yields no chosen/rejected pairs; give a preference dataset such as "
     "toolkit.data.preference_dataset (kto too is validated on held-out pairs)"),
])
def test_kto_on_the_wrong_kind_of_data_is_refused_in_one_line(override, message, tmp_path):
    out = tmp_path / "run"
    result = run_tune_here("run", "preference_finetune_single_device", "--config", "demo_kto", f"output_dir={out}",
                           *FAST, override)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [message]
    assert not out.exists()


def test_tune_plot_draws_the_rewards_of_a_preference_run(single, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from toolkit.cli.main import main
    from toolkit.cli.plot import _panels, plot_runs, read_metrics

    records = read_metrics(single["full"])
    panels = _panels({"full": records}, None)
    assert {"loss", "reward_accuracy", "reward_margin"} <= set(panels)
    figure = plot_runs({"full": records}, panels)
    (accuracy,) = [ax for ax in figure.axes if ax.get_title().startswith("reward accuracy")]
    assert [line.get_label() for line in accuracy.get_lines()] == ["full", "full (validation)"]
    assert main(["plot", str(single["full"]), "--output", str(tmp_path / "p.png")]) == 0
    assert "reward_accuracy last" in capsys.readouterr().out


# The demos as their configs' first command runs them, on 2 processes: each takes half of every batch, so a run
# takes about half as long as on one (measured: 27 s against about a minute for 100 DPO steps, 142 s against about
# 4 minutes for the KTO demo), and trains the same model up to float rounding (promise 1).
DEMO_ON_TWO = ("run", "--nproc_per_node", "2", "preference_finetune_distributed", "--config")


@pytest.mark.slow  # 100 steps of the demo: about half a minute on 2 processes
def test_the_demo_raises_held_out_preference_accuracy_from_chance_to_over_90_percent(tmp_path):
    out = tmp_path / "demo"
    result = run_tune(*DEMO_ON_TWO, "demo", f"output_dir={out}", "max_steps=100", "~eval_tasks",
                      "progress_bar=false", "save_every_n_steps=null", "eval_every_n_steps=null", timeout_s=540)
    assert result.returncode == 0, result.stderr[-3000:]
    held_out = [r for r in records(out) if "val_reward_accuracy" in r]
    assert [r["step"] for r in held_out] == [0, 100] and held_out[0]["val_pairs"] == 200
    assert held_out[0]["val_reward_accuracy"] == 0.5  # the policy is its reference: every reward ties
    assert held_out[1]["val_reward_accuracy"] >= 0.9
    assert "held-out preference accuracy after training" in result.stdout


@pytest.mark.slow  # 500 steps of the KTO demo: about two and a half minutes on 2 processes
def test_the_kto_demo_raises_held_out_preference_accuracy_from_unpaired_answers(tmp_path):
    out = tmp_path / "demo"
    result = run_tune(*DEMO_ON_TWO, "demo_kto", f"output_dir={out}", "~eval_tasks", "progress_bar=false",
                      "save_every_n_steps=null", "eval_every_n_steps=null", timeout_s=540)
    assert result.returncode == 0, result.stderr[-3000:]
    held_out = [r for r in records(out) if "val_reward_accuracy" in r]
    assert [r["step"] for r in held_out] == [0, 500] and held_out[0]["val_pairs"] == 200
    assert held_out[0]["val_reward_accuracy"] == 0.5
    assert held_out[1]["val_reward_accuracy"] >= 0.9
    assert "kto: " in result.stdout and "desirable and" in result.stdout
