"""Step checkpoints end to end: a run killed by SIGKILL and resumed ends exactly where an uninterrupted run does.

Every run is the CPU demo in fp32 on a small slice of its data: deterministic, so "the same run" means bitwise
equal weights and losses on the same number of processes. On a different number of processes the gradient sums are
rounded in another order, so there the losses agree to fp32 rounding (rtol 1e-5, as in the parity tests).

The same holds under tensor parallelism (``tensor_parallel=2``: each rank checkpoints its halves of the layers).

What costs time here is starting processes, not training (a demo run is a second or two of it): the uninterrupted
2-process runs share one launch (``two_process_runs``), the resumes of the killed 2-process runs another
(``killed_then_resumed``), and 1-process runs go through `tune run` in the test's own process (``run_here``). Only
the runs that are killed, and the restart by torchrun, are launches of their own.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import RecipeRun, run_recipes, run_tune, run_tune_here

FAST = [
    "max_steps=8", "dataset.num_samples=256", "progress_bar=false", "~eval_tasks", "batch_size=8",
    "micro_batch_size=2", "save_every_n_steps=3", "keep_last_n=null",
]


def tune(*args: str, fault: str | None = None) -> subprocess.CompletedProcess:
    # An empty TUNE_INJECT_FAULT injects nothing (also overriding one set in the test's own environment).
    return run_tune(*args, env={"TUNE_INJECT_FAULT": fault or ""})


def run(
    output_dir: Path, *overrides: str, nproc: int = 2, fault: str | None = None, restarts: int = 0,
    recipe: str = "full_finetune",
):
    """`tune run` in a new process (torchrun's launcher and its workers for 2 processes or restarts)."""
    launch = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    if restarts:
        launch += ["--max_restarts", str(restarts)]
    recipe += "_distributed" if nproc > 1 or restarts else "_single_device"
    return tune("run", *launch, recipe, "--config", "demo", f"output_dir={output_dir}", *FAST, *overrides, fault=fault)


def run_here(output_dir: Path, *overrides: str, recipe: str = "full_finetune") -> subprocess.CompletedProcess:
    """`tune run <recipe>_single_device` in this process: the same command, exit code and output, no process start."""
    return run_tune_here(
        "run", f"{recipe}_single_device", "--config", "demo", f"output_dir={output_dir}", *FAST, *overrides
    )


def together(output_dir: Path, *overrides: str, recipe: str = "full_finetune") -> RecipeRun:
    """A 2-process run for :func:`run_together`."""
    return RecipeRun(recipe, output_dir, *FAST, *overrides)


def run_together(*runs: RecipeRun, nproc: int = 2) -> None:
    """The runs one after another in one launch of ``nproc`` processes (see ``tests.launch.run_recipes``)."""
    result = run_recipes(list(runs), nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    first = records[0]["step"]
    assert [r["step"] for r in records] == list(range(first, first + len(records))), "every step logged once, in order"
    return [r["loss"] for r in records]


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "final" / "model.safetensors")


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def complete_steps(output_dir: Path) -> list[int]:
    root = output_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.iterdir() if (p / "COMPLETE").is_file())


@pytest.fixture(scope="module")
def reference_single(tmp_path_factory) -> Path:
    """The uninterrupted 1-process run; its checkpoint at step 3 is resumed on 2 processes below."""
    out = tmp_path_factory.mktemp("reference_single")
    result = run_here(out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def two_process_runs(reference_single, tmp_path_factory) -> dict[str, Path]:
    """Every uninterrupted 2-process run of this file, in one launch; by name, the output folder of each:

    - ``reference``: DDP; its checkpoints at steps 3, 6 and 8 are reused below.
    - ``zero1``, ``zero3``: 6 steps under each sharded strategy, whose step 3 is resumed on 1 process.
    - ``keep_last_n``: ``keep_last_n=2`` with asynchronous saves.
    - ``one_process_step_3``: ``reference_single``'s step 3 resumed on 2 processes.
    - ``lora_reference``: LoRA with adapter dropout (the reference of the LoRA kill below).
    - ``dora_zero3``: DoRA under ZeRO-3, whose step 3 is resumed on 1 process.
    - ``tp2``: ``tensor_parallel=2`` (one pair splitting each layer; the reference of the tensor-parallel kill).
    """
    root = tmp_path_factory.mktemp("two_processes")
    runs = {
        "reference": together(root / "reference"),
        "zero1": together(root / "zero1", "data_parallel=zero1", "max_steps=6"),
        "zero3": together(root / "zero3", "data_parallel=zero3", "max_steps=6"),
        "keep_last_n": together(root / "keep_last_n", "keep_last_n=2", "async_save=true"),
        "one_process_step_3": together(
            root / "one_process_step_3", f"resume_from={reference_single / 'checkpoints' / 'step_3'}"
        ),
        "lora_reference": together(root / "lora_reference", LORA_DROPOUT, recipe="lora_finetune"),
        "dora_zero3": together(root / "dora_zero3", *DORA, "data_parallel=zero3", recipe="lora_finetune"),
        "tp2": together(root / "tp2", *TP2),
    }
    run_together(*runs.values())
    return {name: r.output_dir for name, r in runs.items()}


@pytest.fixture(scope="module")
def reference(two_process_runs) -> Path:
    """The uninterrupted 2-process run (DDP); its checkpoints at steps 3, 6 and 8 are reused below."""
    out = two_process_runs["reference"]
    assert complete_steps(out) == [3, 6, 8]
    return out


# Adapter dropout, so that every random draw between the checkpoint and the kill must repeat on resume (the data
# loader's iterator once drew from the global RNG, which the resumed run then drew once more).
LORA_DROPOUT = "model.lora_dropout=0.1"
DORA = ["save_merged=false", "model.use_dora=true"]
# Both processes split each layer and read the same rows: every rank's checkpoint holds its halves of the model
# and of the optimizer state, which the resume (or another layout, through DCP) must put back. 5 steps (saved at 3
# and 5): a tp=2 step costs about twice a DDP one here, and one checkpoint before the kill is all the test needs.
TP2_STEPS = "max_steps=5"
TP2 = ["tensor_parallel=2", TP2_STEPS]
# The 2-process runs killed by SIGKILL: the fault, the overrides, the recipe.
KILLED = {
    "two_processes": ("after_step:7:1", [], "full_finetune"),  # rank 1 dies after step 7; the last checkpoint: 6
    "while_saving": ("save:6", [], "full_finetune"),  # step 6's files are all written, its marker is not
    "async_save": ("after_step:7:1", ["async_save=true"], "full_finetune"),
    "lora": ("after_step:7:1", [LORA_DROPOUT, "save_merged=false"], "lora_finetune"),
    "tp2": ("after_step:4:1", TP2, "full_finetune"),  # the last checkpoint: 3
}


class Killed:
    """A killed run: its folder, what the kill left there, and the stdout of its resume."""

    def __init__(self, output_dir: Path, stdout_file: Path) -> None:
        self.output_dir, self.stdout_file = output_dir, stdout_file
        self.complete_steps = complete_steps(output_dir)
        self.checkpoint_folders = sorted(p.name for p in (output_dir / "checkpoints").iterdir())
        self.has_final = (output_dir / "final").exists()

    @property
    def resumed_stdout(self) -> str:
        return self.stdout_file.read_text()


@pytest.fixture(scope="module")
def killed_then_resumed(tmp_path_factory) -> dict[str, Killed]:
    """Each run of ``KILLED`` killed in its own launch, what it left recorded, then all resumed with
    ``resume_from=auto`` in one launch."""
    root = tmp_path_factory.mktemp("killed")
    killed, resumes = {}, []
    for name, (fault, overrides, recipe) in KILLED.items():
        result = run(root / name, *overrides, fault=fault, recipe=recipe)
        assert result.returncode != 0, f"{name}: the fault {fault} killed nothing"
        resumes.append(together(root / name, *overrides, "resume_from=auto", recipe=recipe))
        killed[name] = Killed(root / name, resumes[-1].stdout_file)
    run_together(*resumes)
    return killed


def assert_same_run(output_dir: Path, reference: Path) -> None:
    assert losses(output_dir) == losses(reference)
    assert_bitwise_equal(weights(output_dir), weights(reference))


@pytest.mark.slow  # killed_then_resumed: five killed launches and the launch of their resumes
def test_sigkill_then_resume_is_bitwise_exact_on_two_processes(killed_then_resumed, reference):
    # Rank 1 died after step 7; the last checkpoint is step 6.
    killed = killed_then_resumed["two_processes"]
    assert killed.complete_steps == [3, 6] and not killed.has_final
    assert "resumed at step 6" in killed.resumed_stdout
    assert_same_run(killed.output_dir, reference)


def test_sigkill_then_resume_is_bitwise_exact_on_one_process(reference_single, tmp_path):
    killed = run(tmp_path, fault="after_step:5", nproc=1)  # a real SIGKILL: the run needs a process of its own
    assert killed.returncode != 0
    resumed = run_here(tmp_path, "resume_from=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 3" in resumed.stdout
    assert_same_run(tmp_path, reference_single)


@pytest.mark.slow  # killed_then_resumed: five killed launches and the launch of their resumes
def test_sigkill_then_resume_is_bitwise_exact_under_tensor_parallelism(
    killed_then_resumed, two_process_runs, tmp_path
):
    # tensor_parallel=2, rank 1 (the second half of every layer) died after step 4; the last checkpoint is step 3.
    # Resumed on the same layout, the run is the uninterrupted tp=2 run's, bitwise.
    killed, reference = killed_then_resumed["tp2"], two_process_runs["tp2"]
    assert killed.complete_steps == [3] and not killed.has_final
    assert "resumed at step 3" in killed.resumed_stdout
    assert_same_run(killed.output_dir, reference)
    # The killed run's step 3 on one process: DCP joins each rank's halves; the whole matmuls sum in another order,
    # so the losses and, 2 AdamW steps on, the weights agree to fp32 rounding (measured: the losses equal, the
    # weights within 3e-6: AdamW's 1/sqrt(v), still small this early, enlarges rounding-level gradient differences on
    # entries with near-zero gradients; 1e-5 as for the layouts in test_tensor_parallel.py).
    resumed = run_here(tmp_path, TP2_STEPS, f"resume_from={killed.output_dir / 'checkpoints' / 'step_3'}")
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path), losses(reference)[3:], rtol=1e-5, atol=0)
    ours, expected = weights(tmp_path), weights(reference)
    assert ours.keys() == expected.keys()
    for key, weight in expected.items():
        torch.testing.assert_close(ours[key], weight, rtol=1e-5, atol=1e-5, msg=key)


def test_two_process_checkpoint_resumes_on_one_process(reference, tmp_path):
    resumed = run_here(tmp_path, f"resume_from={reference / 'checkpoints' / 'step_6'}")
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path), losses(reference)[6:], rtol=1e-5, atol=1e-6)


def test_one_process_checkpoint_resumes_on_two_processes(two_process_runs, reference):
    # reference_single's step 3, resumed on 2 processes (in two_process_runs).
    torch.testing.assert_close(
        losses(two_process_runs["one_process_step_3"]), losses(reference)[3:], rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_sharded_checkpoint_reshards_to_another_world_size_and_strategy(strategy, two_process_runs, reference,
                                                                         tmp_path):
    # Optimizer state sharded by ZeRO-1 (whole parameters per rank) or FSDP2 (rows of every parameter), saved by
    # 2 processes (6 steps, in two_process_runs) and loaded by 1 process with DDP's layout.
    sharded = two_process_runs[strategy]
    resumed = run_here(tmp_path / "resumed", f"resume_from={sharded / 'checkpoints' / 'step_3'}")
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path / "resumed"), losses(reference)[3:], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # killed_then_resumed: five killed launches and the launch of their resumes
def test_kill_while_saving_leaves_the_previous_checkpoint_for_auto(killed_then_resumed, reference):
    # Step 6's files are all written, its marker is not.
    killed = killed_then_resumed["while_saving"]
    assert killed.complete_steps == [3] and "step_6" in killed.checkpoint_folders
    assert "resumed at step 3" in killed.resumed_stdout
    assert_same_run(killed.output_dir, reference)


@pytest.mark.slow  # two worker groups, one after the kill
def test_max_restarts_recovers_from_a_dead_rank(reference, tmp_path):
    result = run(tmp_path, fault="after_step:7:1", restarts=1)  # no resume_from: the restart resumes by itself
    assert result.returncode == 0, result.stderr
    assert_same_run(tmp_path, reference)


def test_tune_export_converts_a_step_checkpoint_offline(reference, tmp_path):
    # The last step checkpoint holds the final weights; written by 2 processes, converted by one.
    result = run_tune_here("export", str(reference / "checkpoints" / "step_8"), "--output", str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    assert_bitwise_equal(load_file(tmp_path / "hf" / "model.safetensors"), weights(reference))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"


def test_a_step_checkpoint_is_a_base_checkpoint_for_a_new_run(reference):
    # checkpointer.checkpoint_dir=<step folder> starts a new run from those weights (tests the loading itself).
    from toolkit.models.llama3 import llama3_demo
    from toolkit.training import HFCheckpointer, materialize

    with torch.device("meta"):
        model = llama3_demo(max_seq_len=64)
    materialize(model, device=torch.device("cpu"))
    HFCheckpointer(str(reference / "checkpoints" / "step_8"), model_family="llama3").load(model)
    final = weights(reference)
    for key, value in model.state_dict().items():
        hf_key = "lm_head.weight" if key == "output.weight" else "model." + key
        assert torch.equal(value, final[hf_key]), key


def test_keep_last_n_prunes_old_checkpoints(two_process_runs):
    # keep_last_n=2 with asynchronous saves (in two_process_runs).
    out = two_process_runs["keep_last_n"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_6", "step_8"]
    assert complete_steps(out) == [6, 8]


@pytest.mark.slow  # killed_then_resumed: five killed launches and the launch of their resumes
def test_async_save_resumes_exactly(killed_then_resumed, reference):
    assert_same_run(killed_then_resumed["async_save"].output_dir, reference)


# --- adapters: step checkpoints hold only the adapters and their optimizer state -----------------------------------


def adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "final" / "adapter" / "adapter_model.safetensors")


@pytest.mark.slow  # killed_then_resumed: five killed launches and the launch of their resumes
def test_lora_sigkill_then_resume_is_bitwise_exact(two_process_runs, killed_then_resumed, tmp_path):
    # With adapter dropout (LORA_DROPOUT): every random draw between the checkpoint and the kill must repeat on
    # resume. The reference is two_process_runs' uninterrupted LoRA run; the kill, after step 7 on rank 1.
    reference = two_process_runs["lora_reference"]
    resumed = killed_then_resumed["lora"].output_dir
    assert losses(resumed) == losses(reference)
    assert_bitwise_equal(adapter(resumed), adapter(reference))
    # Offline, the last step checkpoint becomes the same PEFT adapter and merged model as the run's own export.
    step_8 = resumed / "checkpoints" / "step_8"
    result = run_tune_here("export", str(step_8), "--output", str(tmp_path / "export"), "--merged")
    assert result.returncode == 0, result.stderr
    assert_bitwise_equal(load_file(tmp_path / "export" / "adapter" / "adapter_model.safetensors"), adapter(reference))
    merged = load_file(tmp_path / "export" / "merged" / "model.safetensors")
    assert_bitwise_equal(merged, load_file(reference / "final" / "merged" / "model.safetensors"))
    # Only what trains is saved: no frozen base weight in the checkpoint.
    metadata = (resumed / "checkpoints" / "step_6" / ".metadata").read_bytes()
    assert b"lora_a" in metadata and b"q_proj.weight" not in metadata


def test_dora_zero3_checkpoint_resumes_on_one_process(two_process_runs, tmp_path):
    sharded = two_process_runs["dora_zero3"]  # DoRA under ZeRO-3 on 2 processes
    step_3 = sharded / "checkpoints" / "step_3"
    resumed = run_here(tmp_path / "resumed", *DORA, f"resume_from={step_3}", recipe="lora_finetune")
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path / "resumed"), losses(sharded)[3:], rtol=1e-5, atol=1e-6)


# --- integrity: a bad checkpoint is refused with the file and key, before the run's files are touched -----------


def copy_checkpoint(reference: Path, tmp_path: Path) -> Path:
    step = tmp_path / "ckpt" / "step_6"
    shutil.copytree(reference / "checkpoints" / "step_6", step)
    return step


def refused(
    tmp_path: Path, step: Path, *overrides: str, new_process: bool = False, recipe: str = "full_finetune"
) -> str:
    """The 1-process resume from ``step``, refused with exit 2 before metrics.jsonl is touched; its stderr. In this
    process (`tune run` on one device runs the recipe in its own process), or with ``new_process`` in a new one."""
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    if new_process:
        result = run(out, f"resume_from={step}", *overrides, nproc=1, recipe=recipe)
    else:
        result = run_here(out, f"resume_from={step}", *overrides, recipe=recipe)
    assert result.returncode == 2, result.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n', "nothing overwritten"
    return result.stderr


def test_truncated_file_is_named(reference, tmp_path):
    step = copy_checkpoint(reference, tmp_path)
    shard = step / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "__1_0.distcp: truncated" in refused(tmp_path, step, new_process=True)  # the command end to end, once


def test_corrupt_metadata_is_named(reference, tmp_path):
    step = copy_checkpoint(reference, tmp_path)
    (step / ".metadata").write_bytes(b"garbage")
    assert ".metadata: unreadable" in refused(tmp_path, step)


def test_incomplete_checkpoint_is_refused(reference, tmp_path):
    step = copy_checkpoint(reference, tmp_path)
    (step / "COMPLETE").unlink()
    assert "not a complete checkpoint" in refused(tmp_path, step)


def test_other_model_config_is_refused(reference, tmp_path):
    step = copy_checkpoint(reference, tmp_path)
    assert "model.vocab_size" in refused(tmp_path, step, "model.vocab_size=400")


def test_shape_mismatch_is_named(reference, tmp_path):
    # A checkpoint whose config claims this model but whose tensors are another's: caught by shape, by key.
    step = copy_checkpoint(reference, tmp_path)
    config = step / "config.yaml"
    config.write_text(config.read_text().replace("model:\n", "model:\n  vocab_size: 400\n", 1))
    stderr = refused(tmp_path, step, "model.vocab_size=400")
    assert "'model.embed_tokens.weight' has shape (384, 128) in the checkpoint but (400, 128) here" in stderr


# --- what a checkpoint may resume: its own recipe and method, up to the run's last step; a finished run is left be ----


def test_a_checkpoint_past_max_steps_is_refused_naming_its_step_and_max_steps(reference_single, tmp_path):
    # step_6 with max_steps=4: taking it as finished would export step 6's weights as a 4-step run's; training on
    # from step 6 would never reach step 4. Every training recipe resumes through recipe_setup.resume_point.
    stderr = refused(tmp_path, reference_single / "checkpoints" / "step_6", "max_steps=4")
    assert stderr.strip() == (
        f"tune: error: resume_from: {reference_single / 'checkpoints' / 'step_6'} is at step 6, past this run's last step, "
        "4 (max_steps=4); raise it to train on from there, or export that checkpoint (tune export)"
    )


def test_auto_on_a_finished_run_says_it_is_complete_and_changes_nothing(reference_single, tmp_path):
    out = tmp_path / "finished"
    shutil.copytree(reference_single, out)
    before = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    result = run_here(out, "resume_from=auto")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        f"{out}: the run is complete: its last step checkpoint, step_8, is at step 8 of 8 and final/ is written; "
        "nothing to do (raise max_steps or epochs to train on)"
    )
    assert "resumed" not in result.stdout and result.stderr == ""
    after = {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    assert after == before, "metrics.jsonl, final/ and the checkpoints byte-identical"


def test_a_checkpoint_resumes_only_under_the_recipe_and_method_that_wrote_it(reference_single, tmp_path):
    step = reference_single / "checkpoints" / "step_6"
    state = json.loads((step / "trainer_state.json").read_text())
    assert (state["recipe"], state["method"]) == ("full_finetune", "full")
    # A full fine-tune's checkpoint fits a full preference run's model: only the record tells them apart.
    stderr = refused(tmp_path, step, "preference_loss=dpo", recipe="preference_finetune")
    assert stderr.strip() == (
        f"tune: error: {step / 'trainer_state.json'}: written by the full_finetune recipe (full), but this run is the "
        "preference_finetune recipe (full): another recipe's checkpoint does not resume here; resume it with "
        "full_finetune (full), or start a new run"
    )
    # resume_from=auto meeting another recipe's run folder: the same line, for its newest checkpoint.
    other = tmp_path / "full_run"
    shutil.copytree(reference_single, other)
    auto = run_here(other, "preference_loss=dpo", "resume_from=auto", recipe="preference_finetune")
    assert auto.returncode == 2 and auto.stderr.strip().splitlines() == [(
        f"tune: error: {other / 'checkpoints' / 'step_8' / 'trainer_state.json'}: written by the full_finetune recipe "
        "(full), but this run is the preference_finetune recipe (full): another recipe's checkpoint does not resume "
        "here; resume it with full_finetune (full), or start a new run"
    )]
    # Another method of the same recipe (here recorded by hand): named too.
    dora = tmp_path / "dora" / "step_6"
    shutil.copytree(step, dora)
    (dora / "trainer_state.json").write_text(json.dumps({**state, "method": "dora"}))
    assert "written by the full_finetune recipe (dora), but this run is the full_finetune recipe (full): another " \
        "method's checkpoint" in refused(tmp_path, dora)
    # A checkpoint from before the record: unknown, so it resumes as it always did.
    old = tmp_path / "old" / "step_6"
    shutil.copytree(step, old)
    unrecorded = {key: value for key, value in state.items() if key not in ("recipe", "method")}
    (old / "trainer_state.json").write_text(json.dumps(unrecorded))
    result = run_here(tmp_path / "resumed_old", f"resume_from={old}")
    assert result.returncode == 0, result.stderr
    assert losses(tmp_path / "resumed_old") == losses(reference_single)[6:]
