"""Step checkpoints end to end: a run killed by SIGKILL and resumed ends exactly where an uninterrupted run does.

Every run is the CPU demo in fp32 on a small slice of its data: deterministic, so "the same run" means bitwise
equal weights and losses on the same number of processes. On a different number of processes the gradient sums are
rounded in another order, so there the losses agree to fp32 rounding (rtol 1e-5, as in the parity tests).
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.launch import run_tune

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
    launch = ["--nproc_per_node", str(nproc)] if nproc > 1 else []
    if restarts:
        launch += ["--max_restarts", str(restarts)]
    recipe += "_distributed" if nproc > 1 or restarts else "_single_device"
    return tune("run", *launch, recipe, "--config", "demo", f"output_dir={output_dir}", *FAST, *overrides, fault=fault)


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
def reference(tmp_path_factory) -> Path:
    """The uninterrupted 2-process run (DDP); its checkpoints at steps 3, 6 and 8 are reused below."""
    out = tmp_path_factory.mktemp("reference")
    result = run(out)
    assert result.returncode == 0, result.stderr
    assert complete_steps(out) == [3, 6, 8]
    return out


@pytest.fixture(scope="module")
def reference_single(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference_single")
    result = run(out, nproc=1)
    assert result.returncode == 0, result.stderr
    return out


def kill_then_resume(output_dir: Path, fault: str, *overrides: str, killed_state=None, **launch) -> str:
    """Run until ``fault`` kills a rank, check what is left (``killed_state(output_dir)``), resume with
    ``resume_from=auto``; returns the resumed run's stdout."""
    killed = run(output_dir, *overrides, fault=fault, **launch)
    assert killed.returncode != 0
    if killed_state is not None:
        killed_state(output_dir)
    resumed = run(output_dir, *overrides, "resume_from=auto", **launch)
    assert resumed.returncode == 0, resumed.stderr
    return resumed.stdout


def assert_same_run(output_dir: Path, reference: Path) -> None:
    assert losses(output_dir) == losses(reference)
    assert_bitwise_equal(weights(output_dir), weights(reference))


def test_sigkill_then_resume_is_bitwise_exact_on_two_processes(reference, tmp_path):
    def left(out: Path) -> None:
        assert complete_steps(out) == [3, 6] and not (out / "final").exists()

    # Rank 1 dies after step 7; the last checkpoint is step 6.
    assert "resumed at step 6" in kill_then_resume(tmp_path, "after_step:7:1", killed_state=left)
    assert_same_run(tmp_path, reference)


def test_sigkill_then_resume_is_bitwise_exact_on_one_process(reference_single, tmp_path):
    assert "resumed at step 3" in kill_then_resume(tmp_path, "after_step:5", nproc=1)
    assert_same_run(tmp_path, reference_single)


def test_two_process_checkpoint_resumes_on_one_process(reference, tmp_path):
    resumed = run(tmp_path, f"resume_from={reference / 'checkpoints' / 'step_6'}", nproc=1)
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path), losses(reference)[6:], rtol=1e-5, atol=1e-6)


def test_one_process_checkpoint_resumes_on_two_processes(reference_single, reference, tmp_path):
    resumed = run(tmp_path, f"resume_from={reference_single / 'checkpoints' / 'step_3'}")
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path), losses(reference)[3:], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_sharded_checkpoint_reshards_to_another_world_size_and_strategy(strategy, reference, tmp_path):
    # Optimizer state sharded by ZeRO-1 (whole parameters per rank) or FSDP2 (rows of every parameter), saved by
    # 2 processes and loaded by 1 process with DDP's layout.
    sharded = tmp_path / strategy
    result = run(sharded, f"data_parallel={strategy}", "max_steps=6")
    assert result.returncode == 0, result.stderr
    resumed = run(tmp_path / "resumed", f"resume_from={sharded / 'checkpoints' / 'step_3'}", nproc=1)
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path / "resumed"), losses(reference)[3:], rtol=1e-5, atol=1e-6)


def test_kill_while_saving_leaves_the_previous_checkpoint_for_auto(reference, tmp_path):
    def left(out: Path) -> None:
        assert complete_steps(out) == [3] and (out / "checkpoints" / "step_6").is_dir()

    # Step 6's files are all written, its marker is not.
    assert "resumed at step 3" in kill_then_resume(tmp_path, "save:6", killed_state=left)
    assert_same_run(tmp_path, reference)


def test_max_restarts_recovers_from_a_dead_rank(reference, tmp_path):
    result = run(tmp_path, fault="after_step:7:1", restarts=1)  # no resume_from: the restart resumes by itself
    assert result.returncode == 0, result.stderr
    assert_same_run(tmp_path, reference)


def test_tune_export_converts_a_step_checkpoint_offline(reference, tmp_path):
    # The last step checkpoint holds the final weights; written by 2 processes, converted by one.
    result = tune("export", str(reference / "checkpoints" / "step_8"), "--output", str(tmp_path / "hf"))
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


def test_keep_last_n_prunes_old_checkpoints(tmp_path):
    result = run(tmp_path, "keep_last_n=2", "async_save=true")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_6", "step_8"]
    assert complete_steps(tmp_path) == [6, 8]


def test_async_save_resumes_exactly(reference, tmp_path):
    kill_then_resume(tmp_path, "after_step:7:1", "async_save=true")
    assert_same_run(tmp_path, reference)


# --- adapters: step checkpoints hold only the adapters and their optimizer state -----------------------------------


def adapter(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(output_dir / "final" / "adapter" / "adapter_model.safetensors")


def test_lora_sigkill_then_resume_is_bitwise_exact(tmp_path):
    # With adapter dropout, so that every random draw between the checkpoint and the kill must repeat on resume
    # (the data loader's iterator once drew from the global RNG, which the resumed run then drew once more).
    dropout = "model.lora_dropout=0.1"
    reference = run(tmp_path / "reference", dropout, recipe="lora_finetune")
    assert reference.returncode == 0, reference.stderr
    kill_then_resume(tmp_path / "run", "after_step:7:1", dropout, "save_merged=false", recipe="lora_finetune")
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")
    assert_bitwise_equal(adapter(tmp_path / "run"), adapter(tmp_path / "reference"))
    # Offline, the last step checkpoint becomes the same PEFT adapter and merged model as the run's own export.
    step_8 = tmp_path / "run" / "checkpoints" / "step_8"
    result = tune("export", str(step_8), "--output", str(tmp_path / "export"), "--merged")
    assert result.returncode == 0, result.stderr
    assert_bitwise_equal(
        load_file(tmp_path / "export" / "adapter" / "adapter_model.safetensors"), adapter(tmp_path / "reference")
    )
    merged = load_file(tmp_path / "export" / "merged" / "model.safetensors")
    assert_bitwise_equal(merged, load_file(tmp_path / "reference" / "final" / "merged" / "model.safetensors"))
    # Only what trains is saved: no frozen base weight in the checkpoint.
    metadata = (tmp_path / "run" / "checkpoints" / "step_6" / ".metadata").read_bytes()
    assert b"lora_a" in metadata and b"q_proj.weight" not in metadata


def test_dora_zero3_checkpoint_resumes_on_one_process(tmp_path):
    dora = ["save_merged=false", "model.use_dora=true"]
    sharded = run(tmp_path / "zero3", *dora, "data_parallel=zero3", recipe="lora_finetune")
    assert sharded.returncode == 0, sharded.stderr
    step_3 = tmp_path / "zero3" / "checkpoints" / "step_3"
    resumed = run(tmp_path / "resumed", *dora, f"resume_from={step_3}", nproc=1, recipe="lora_finetune")
    assert resumed.returncode == 0, resumed.stderr
    torch.testing.assert_close(losses(tmp_path / "resumed"), losses(tmp_path / "zero3")[3:], rtol=1e-5, atol=1e-6)


# --- integrity: a bad checkpoint is refused with the file and key, before the run's files are touched -----------


def copy_checkpoint(reference: Path, tmp_path: Path) -> Path:
    step = tmp_path / "ckpt" / "step_6"
    shutil.copytree(reference / "checkpoints" / "step_6", step)
    return step


def refused(tmp_path: Path, step: Path, *overrides: str) -> str:
    out = tmp_path / "run"
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    result = run(out, f"resume_from={step}", *overrides, nproc=1)
    assert result.returncode == 2, result.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n', "nothing overwritten"
    return result.stderr


def test_truncated_file_is_named(reference, tmp_path):
    step = copy_checkpoint(reference, tmp_path)
    shard = step / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    assert "__1_0.distcp: truncated" in refused(tmp_path, step)


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
