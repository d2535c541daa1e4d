"""The eval recipe end to end: a fine-tuned demo model beats a random one, 2 processes report what 1 does, and a
LoRA adapter loads on its base, with the LoRA model restated in the config or built from the adapter's settings (by
the generate recipe too).

The training runs and the evaluations on 2 processes share one launch (``launched``); the 1-process evaluations
run in the test's own process."""

import json
import math
from pathlib import Path

import pytest
import torch

import toolkit.generation
from tests.launch import RecipeRun, run_recipe_here, run_recipes, run_tune_here
from toolkit.errors import UserError


def tune(*args: str):
    """``tune *args`` in this process (commands that start no process); a non-zero exit fails the test."""
    result = run_tune_here(*args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


# The demo restricted to one task family (upper-casing), which the demo model learns within 150 steps (all four
# families together take well over 300 steps on a CPU), and 100 held-out samples for both measures. An answer is
# 4 letters and the stop token: 6 new tokens are enough, and spare the random model 10 useless ones per sample.
TASK = ["dataset.tasks=[upper]"]
EVAL = [
    *TASK, "eval_tasks.tasks=[upper]", "dataset.num_samples=100", "eval_tasks.num_samples=100", "eval_max_new_tokens=6",
]
LORA_MODEL = (
    "model={_component_: toolkit.models.llama3.lora_llama3_demo, max_seq_len: 64, lora_rank: 16, lora_alpha: 32, "
    "lora_attn_modules: [q_proj, k_proj, v_proj, o_proj], apply_lora_to_mlp: true, apply_lora_to_output: true}"
)


def evaluate(out: Path, *overrides: str) -> dict:
    """``tune run eval --config demo`` (one device: in this process, as `tune run` runs it)."""
    return read_report(out, tune("run", "eval", "--config", "demo", f"output_dir={out}", *EVAL, *overrides).stdout)


def read_report(out: Path, stdout: str) -> dict:
    report = json.loads((out / "eval.json").read_text())
    assert f"{report['val_loss']:.4f}" in stdout, "the table shows the numbers of eval.json"
    return report


def evaluate_here(out: Path, *overrides: str) -> dict:
    """The eval recipe's ``main`` on the demo config, in this process (no interpreter start: faster)."""
    run_recipe_here("eval", "demo", f"output_dir={out}", *EVAL, *overrides)
    return json.loads((out / "eval.json").read_text())


SMALL = ["dataset.num_samples=32", "eval_tasks.num_samples=8"]
# The eval recipe rebuilds the training run's random base from the same seed.
LORA = ["checkpointer.checkpoint_dir=null", LORA_MODEL, *SMALL]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Every run on 2 processes, one after another in one launch: the full fine-tune (``fine_tuned``), the LoRA run
    (``lora_run``), then the evaluations under zero3 (FSDP2) of each (``sharded_reports``). Training on 2
    processes takes half the time of 1 (the 150 steps: 33 s against 60 s) and trains the same model up to float
    rounding (promise 1)."""
    root = tmp_path_factory.mktemp("launched")
    full, lora = root / "full", root / "lora"
    sharded = {
        "fine_tuned": RecipeRun(
            "eval", root / "eval_fine_tuned", *EVAL, f"checkpointer.checkpoint_dir={full / 'final'}",
            "data_parallel=zero3",
        ),
        "lora": RecipeRun(
            "eval", root / "eval_lora", *EVAL, *LORA, f"adapter_dir={lora / 'final' / 'adapter'}", "data_parallel=zero3"
        ),
    }
    runs = [
        # The global batch of 32 in one micro-batch of 16 per process, as one process takes it in one of 32.
        RecipeRun(
            "full_finetune", full, "max_steps=150", "dataset.num_samples=4800", "micro_batch_size=16",
            "progress_bar=false", "save_every_n_steps=null", "~eval_tasks", *TASK,
        ),
        RecipeRun(
            "lora_finetune", lora, "max_steps=20", "batch_size=16", "micro_batch_size=8", "dataset.num_samples=320",
            "progress_bar=false", "save_every_n_steps=null", *TASK,
        ),
        *sharded.values(),
    ]
    result = run_recipes(runs, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return {
        "fine_tuned": full / "final",
        "lora_run": lora,
        "sharded_reports": {name: read_report(r.output_dir, r.stdout()) for name, r in sharded.items()},
    }


@pytest.fixture(scope="module")
def fine_tuned(launched) -> Path:
    """The demo fine-tuned for 150 steps on the upper-casing task (2 processes): its ``final`` folder."""
    return launched["fine_tuned"]


@pytest.fixture(scope="module")
def fine_tuned_report(fine_tuned, tmp_path_factory) -> dict:
    return evaluate(tmp_path_factory.mktemp("eval_full"), f"checkpointer.checkpoint_dir={fine_tuned}")


@pytest.mark.slow  # `launched`: 150 training steps and four other runs, about a minute
def test_fine_tuned_checkpoint_beats_a_random_model(fine_tuned, fine_tuned_report, tmp_path):
    base = evaluate_here(tmp_path, "checkpointer.checkpoint_dir=null")
    tuned = fine_tuned_report
    assert base["checkpoint_dir"] is None and tuned["checkpoint_dir"] == str(fine_tuned)
    for report in (base, tuned):
        assert report["val_tokens"] > 0 and report["total"] == 100
        assert report["val_perplexity"] == pytest.approx(math.exp(report["val_loss"]))
    assert tuned["accuracy"] > 0.5 > base["accuracy"]
    assert tuned["val_loss"] < base["val_loss"]


@pytest.mark.slow  # `launched`: 150 training steps and four other runs, about a minute
def test_two_processes_report_what_one_does(fine_tuned_report, sharded_reports):
    # Sharded (FSDP2): every forward is a collective, and 100 samples split 50/50 into 4 micro-batches each.
    sharded = sharded_reports["fine_tuned"]
    assert sharded["val_tokens"] == fine_tuned_report["val_tokens"]
    assert (sharded["correct"], sharded["total"]) == (fine_tuned_report["correct"], fine_tuned_report["total"])
    # The same tokens in other batches (other padded lengths) round differently in float32; see
    # tests/training/test_validation.py for why 1e-6 relative is the bound.
    assert sharded["val_loss"] == pytest.approx(fine_tuned_report["val_loss"], rel=1e-6)


@pytest.fixture(scope="module")
def lora_run(launched) -> Path:
    """The LoRA demo (a random base from the seed) trained for 20 steps (2 processes): ``final/adapter`` and
    ``final/merged``."""
    return launched["lora_run"]


@pytest.fixture(scope="module")
def sharded_reports(launched) -> dict[str, dict]:
    """The evaluations on 2 processes under zero3 (FSDP2): ``fine_tuned``, and the LoRA adapter of ``lora_run`` on
    its random base (the LoRA model restated in the config)."""
    return launched["sharded_reports"]


@pytest.fixture(scope="module")
def lora_report(lora_run, tmp_path_factory) -> dict:
    """The adapter evaluated on the LoRA model restated in the config."""
    return evaluate_here(tmp_path_factory.mktemp("adapted"), *LORA, f"adapter_dir={lora_run / 'final' / 'adapter'}")


@pytest.mark.slow  # `launched`: 150 training steps and four other runs, about a minute
def test_lora_adapter_on_its_random_base(lora_run, lora_report, sharded_reports, tmp_path):
    train = lora_run
    # The LoRA model without an adapter folder computes exactly that base (B = 0).
    without = evaluate_here(tmp_path / "base", *LORA)
    adapted = lora_report
    # The training run's own export of base and adapter merged, as a plain model: the same function.
    merged = evaluate_here(tmp_path / "merged", f"checkpointer.checkpoint_dir={train / 'final' / 'merged'}", *SMALL)
    assert adapted["adapter_dir"] == str(train / "final" / "adapter")
    assert 0 <= adapted["accuracy"] <= 1 and adapted["val_tokens"] == without["val_tokens"] == merged["val_tokens"]
    assert adapted["val_loss"] < without["val_loss"], "20 LoRA steps lower the loss: the adapter was applied"
    # W + s B A computed once (merged) versus x W + s (x A) B: float32 rounding in another order, ~1e-7 relative
    # per logit; a different random base or a misplaced adapter would be off by far more.
    assert merged["val_loss"] == pytest.approx(adapted["val_loss"], rel=1e-5)
    # The adapter on a sharded base (2 processes, FSDP2): the random base and the adapter land in every shard.
    sharded = sharded_reports["lora"]
    assert sharded["val_tokens"] == adapted["val_tokens"]
    assert sharded["val_loss"] == pytest.approx(adapted["val_loss"], rel=1e-6)  # as in the test above


@pytest.mark.slow  # `launched`: 150 training steps and four other runs, about a minute
def test_adapter_on_the_plain_model_config_needs_no_restated_lora_model(lora_run, lora_report, tmp_path):
    # The demo config's own `model` (llama3_demo): the LoRA model comes from the adapter's adapter_config.json.
    plain = evaluate_here(
        tmp_path, "checkpointer.checkpoint_dir=null", *SMALL, f"adapter_dir={lora_run / 'final' / 'adapter'}"
    )
    # The same modules built in the same order: the same random base, adapter and arithmetic, so the same numbers.
    assert plain == lora_report


@pytest.mark.slow  # `launched`: 150 training steps and four other runs, about a minute
def test_generate_rebuilds_the_lora_demo_from_its_seed_and_adapter(lora_run, monkeypatch, capsys):
    # The generate config's header example: the LoRA demo's random base from the seed, its adapter on the plain
    # llama3_demo. The model generate decodes with must compute the run's own merged export.
    generate, models = toolkit.generation.generate, []

    def recording_generate(model, *args, **kwargs) -> list[int]:
        models.append(model)
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(toolkit.generation, "generate", recording_generate)
    run_recipe_here(
        "generate", "demo", "checkpointer.checkpoint_dir=null", f"adapter_dir={lora_run / 'final' / 'adapter'}"
    )
    adapted = capsys.readouterr().out
    run_recipe_here("generate", "demo", f"checkpointer.checkpoint_dir={lora_run / 'final' / 'merged'}")
    assert adapted == capsys.readouterr().out
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # fp32 rounding only: W x + s B A x versus the merged (W + s B A) x differ by ~5e-6 on these logits (up to
        # ~8); the base of another seed is off by ~4.
        torch.testing.assert_close(models[0](tokens), models[1](tokens), atol=1e-4, rtol=0)


def test_adapter_dir_must_be_an_adapter_folder(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with pytest.raises(UserError, match=r"adapter_config\.json: missing; is .* a PEFT adapter folder"):
        evaluate_here(tmp_path, "checkpointer.checkpoint_dir=null", f"adapter_dir={adapter}")
    assert not (tmp_path / "eval.json").exists()
