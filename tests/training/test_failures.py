"""Bad data-parallel settings stop before training with one line; a crashing rank is reported, not a hang.

The 2-process runs that succeed share one launch (``two_process_runs``); the launches that fail or restart are
their own; 1-process runs go through `tune run` in the test's own process."""

import subprocess
from pathlib import Path

import pytest
import torch

from tests.launch import RecipeRun, run_recipes, run_tune, run_tune_here
from toolkit.errors import UserError
from toolkit.parallel import parallel_dims
from toolkit.training import StepCheckpointer, claim_output_dir, find_resume_checkpoint, precision_policy, start_run

FAST = ["max_steps=2", "dataset.num_samples=64", "progress_bar=false", "~eval_tasks", "batch_size=4", "micro_batch_size=2"]


def tune_run(tmp_path: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return run_tune(
        "run", "--nproc_per_node", str(nproc), "full_finetune_distributed", "--config", "demo",
        f"output_dir={tmp_path}", *FAST, *args, timeout_s=180,
    )


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"strategy": "zero4"}, "unknown strategy 'zero4'"),
        ({"strategy": "hsdp", "shard_size": 3}, "cannot be split into shard groups of 3"),
        ({"strategy": "ddp", "cpu_offload": True}, "needs a sharded strategy"),
        ({"strategy": "zero3", "cpu_offload": True, "device_type": "cpu"}, "already runs on the CPU"),
        # one process is left unsharded: its cpu_offload would be ignored while the memory plan counted it
        ({"strategy": "zero3", "cpu_offload": True, "world_size": 1, "local_world_size": 1},
         "cpu_offload: offloads the shards of a model sharded over 2 or more processes, and one process has none"),
        ({"strategy": "ddp", "tensor_parallel": 3}, "tensor_parallel: 3 does not divide the 4 processes"),
        ({"strategy": "zero1", "tensor_parallel": 2}, "data_parallel: zero1 cannot combine with tensor_parallel=2"),
        ({"strategy": "zero3", "cpu_offload": True, "tensor_parallel": 2}, "cpu_offload: cannot combine with"),
    ],
)
def test_bad_layouts(kwargs, message):
    kwargs = {"world_size": 4, "local_world_size": 4, **kwargs}
    with pytest.raises(UserError, match=message):
        parallel_dims(**kwargs)


def test_hsdp_layout():
    dims = parallel_dims(strategy="hsdp", world_size=8, local_world_size=4)
    assert (dims.dp_replicate, dims.dp_shard) == (2, 4)


@pytest.mark.parametrize(
    "strategy,shard_size,layout",
    [("ddp", None, (4, 1, 2)), ("zero3", None, (1, 4, 2)), ("hsdp", 2, (2, 2, 2)), ("hsdp", None, (2, 2, 2))],
)
def test_tensor_parallel_layouts(strategy, shard_size, layout):
    # 8 processes, 4 a node, tensor_parallel=2: the strategies span the 4 data-parallel ranks (HSDP shards within a
    # node's 2 data-parallel ranks by default); rank 5 is data-parallel rank 2 (TP innermost).
    dims = parallel_dims(strategy=strategy, world_size=8, local_world_size=4, shard_size=shard_size,
                         tensor_parallel=2, rank=5)
    assert (dims.dp_replicate, dims.dp_shard, dims.tp) == layout
    assert (dims.world_size, dims.dp_size, dims.dp_rank) == (8, 4, 2)
    assert dims.uses_fsdp


def test_dtypes(monkeypatch):
    with pytest.raises(UserError, match="unknown value 'fp8'"):
        precision_policy("fp8", device=torch.device("cpu"))
    mixed = precision_policy("bf16-mixed", device=torch.device("cpu"))
    assert mixed.param_dtype == torch.float32 and mixed.compute_dtype == torch.bfloat16 and not mixed.needs_grad_scaler
    assert precision_policy("fp16-mixed", device=torch.device("cpu")).needs_grad_scaler
    # A GPU without bf16 (pre-Ampere) is refused with the advice to use fp16-mixed.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(UserError, match="Tesla V100 lacks; use fp16-mixed"):
        precision_policy("bf16", device=torch.device("cuda", 0))


def test_cpu_offload_with_ddp_is_one_line_before_training(tmp_path):
    result = tune_run(tmp_path, "data_parallel=ddp", "cpu_offload=true")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "cpu_offload" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_crashing_rank_is_named_and_the_others_do_not_hang(tmp_path):
    # Rank 0 goes on to a collective and waits there for rank 1. The collective timeout is 600 s and tune_run's
    # subprocess timeout 180 s: only the launcher ending the group when rank 1 dies lets this return at all.
    result = tune_run(
        tmp_path, "dataset._component_=tests.training.faulty_components.dataset_failing_on_rank_one",
        "dist_timeout_s=600",
    )
    assert result.returncode == 1
    # The launcher's closing line names the failed rank and its exception.
    last_line = result.stderr.strip().splitlines()[-1]
    assert "rank 1" in last_line and "RuntimeError: injected failure on rank 1" in last_line


# The held-out evaluation's settings (see its test below): a collective timeout low enough that a regression fails
# fast. Every run of the launch below has it: the process group, formed by the launch's first run, keeps it.
EVAL = ["eval_tasks.num_samples=6", "dist_timeout_s=60"]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory) -> dict[str, RecipeRun]:
    """The 2-process runs of this file that succeed, in one launch, by name."""
    root = tmp_path_factory.mktemp("two_processes")
    fast_without_eval = [arg for arg in FAST if arg != "~eval_tasks"]
    runs = {
        **{f"eval_{strategy}": RecipeRun("full_finetune", root / f"eval_{strategy}", *fast_without_eval, *EVAL,
                                         f"data_parallel={strategy}") for strategy in ("ddp", "zero3")},
        "metrics": RecipeRun("full_finetune", root / "metrics", *FAST, "dist_timeout_s=60", "log_every_n_steps=1"),
        "auto": RecipeRun("full_finetune", root / "auto", *FAST, "dist_timeout_s=60", "data_parallel=auto",
                          "device_memory_gb=24"),
    }
    result = run_recipes(list(runs.values()), nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return runs


def test_metrics_gather_per_rank_figures(two_process_runs):
    import json

    # log_every_n_steps=1 on 2 processes.
    record = json.loads((two_process_runs["metrics"].output_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["rank_step_time_s_max"] >= record["rank_step_time_s_min"] > 0
    assert record["slowest_rank"] in (0, 1)
    assert record["rank_peak_memory_gib_max"] > 0
    # The step-time split: forward and backward, then the optimizer (the rest of the step); the data wait before it.
    assert record["forward_backward_s"] > 0 and record["optimizer_s"] > 0
    assert record["forward_backward_s"] + record["optimizer_s"] == pytest.approx(record["step_time_s"], rel=1e-9)
    assert record["rank_data_wait_s_max"] >= record["rank_data_wait_s_min"] >= 0 and record["data_wait_s"] >= 0


def test_auto_strategy_is_resolved_and_explained(two_process_runs):
    # data_parallel=auto device_memory_gb=24 on 2 processes.
    assert "data_parallel: auto -> ddp needs" in two_process_runs["auto"].stdout()


def test_auto_without_device_memory_on_cpu_is_one_line(tmp_path):
    result = run_tune_here("run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path}", *FAST,
                           "data_parallel=auto")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "device_memory_gb" in result.stderr


def test_held_out_evaluation_under_zero3_matches_ddp(two_process_runs):
    """Sharded layers all-gather in every forward: evaluation must not let ranks run different numbers of
    forwards (which waited for the collective timeout, set low here so a regression fails fast)."""
    lines = {}
    for strategy in ("ddp", "zero3"):
        # 2 steps on 2 processes, held-out accuracy on 6 samples before and after training (EVAL).
        stdout = two_process_runs[f"eval_{strategy}"].stdout()
        lines[strategy] = [line for line in stdout.splitlines() if line.startswith("held-out accuracy")]
        assert len(lines[strategy]) == 2 and all(line.endswith("/6)") for line in lines[strategy])
    assert lines["zero3"] == lines["ddp"]


def completed_by_job(monkeypatch, output_dir: Path, step: int, job: str) -> Path:
    """A ``step_<step>`` folder in ``output_dir`` marked complete by the torchrun job ``job``."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    path = output_dir / "checkpoints" / f"step_{step}"
    path.mkdir(parents=True)
    StepCheckpointer(output_dir, every_n_steps=1)._finish(path)
    return path


def test_a_restart_resumes_from_its_own_newest_checkpoint_not_resume_from(tmp_path, monkeypatch):
    monkeypatch.delenv("TUNE_INJECT_FAULT", raising=False)
    started_from = completed_by_job(monkeypatch, tmp_path / "earlier", 3, "job-a")
    output_dir = tmp_path / "run"
    stale = completed_by_job(monkeypatch, output_dir, 9, "job-a")  # another run's, left in output_dir
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    # A first launch resumes from the folder it is given, whatever output_dir holds.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert find_resume_checkpoint(str(started_from), output_dir) == started_from
    # Restarted before it completed a checkpoint of its own, it goes back there (not to the stale one)...
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert find_resume_checkpoint(str(started_from), output_dir) == started_from
    # ...and once it has one, to its newest.
    own = completed_by_job(monkeypatch, output_dir, 6, "job-b")
    assert find_resume_checkpoint(str(started_from), output_dir) == own
    assert find_resume_checkpoint("auto", output_dir) == stale  # auto: the newest in output_dir, as before



def test_a_fresh_start_checks_the_folder_first_and_clears_it_only_when_claimed(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    old = tmp_path / "run"
    (old / "final").mkdir(parents=True)
    (old / "metrics.jsonl").write_text("{}\n")
    (old / "tensorboard").mkdir()
    with pytest.raises(UserError, match="already holds a run"):
        start_run(old, overwrite=False, resume_from=None)
    # overwrite=true: checked, but nothing is removed until the recipe claims the folder (its inputs all built).
    assert start_run(old, overwrite=True, resume_from=None) is None
    assert (old / "metrics.jsonl").is_file() and (old / "final").is_dir()
    claim_output_dir(old, overwrite=True)
    assert sorted(p.name for p in old.iterdir()) == [".job"]  # the old run's TensorBoard events go with it
    # A restart of the same job before its first checkpoint starts afresh over its own files, without overwrite,
    # and keeps what else the folder holds.
    (old / "metrics.jsonl").write_text("{}\n")
    (old / "notes.txt").write_text("the user's own file")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert start_run(old, overwrite=False, resume_from=None) is None
    claim_output_dir(old, overwrite=False)
    assert sorted(p.name for p in old.iterdir()) == [".job", "notes.txt"]
    # Another job's files are not its own.
    (old / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    with pytest.raises(UserError, match="already holds a run"):
        start_run(old, overwrite=False, resume_from=None)

@pytest.mark.slow  # a 1-process run, then two worker groups
def test_max_restarts_after_resume_from_continues_from_the_new_checkpoint(tmp_path):
    """A run started from another run's step_3 saves step_4, loses rank 1 after step 5, and is restarted by torchrun:
    it must go on from step_4, not from step_3 again (promise 3: only the steps since the last checkpoint are lost)."""
    tiny = [*FAST[1:], "dist_timeout_s=60"]  # FAST without its max_steps
    first = run_tune_here(
        "run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'first'}", *tiny,
        "max_steps=3", "save_every_n_steps=3",
    )
    started_from = tmp_path / "first" / "checkpoints" / "step_3"
    assert first.returncode == 0, first.stderr[-3000:]
    assert (started_from / "COMPLETE").is_file()
    result = run_tune(
        "run", "--nproc_per_node", "2", "--max_restarts", "1", "full_finetune_distributed", "--config", "demo",
        f"output_dir={tmp_path / 'second'}", *tiny, "max_steps=6", "save_every_n_steps=2",
        f"resume_from={started_from}", env={"TUNE_INJECT_FAULT": "after_step:5:1"}, timeout_s=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resumed at step")]
    assert resumed == [f"resumed at step 3 from {started_from}",
                       f"resumed at step 4 from {tmp_path / 'second' / 'checkpoints' / 'step_4'}"], result.stdout
    assert "restart 1: resuming from" in result.stderr and "not from resume_from=" in result.stderr
    import json

    steps = [json.loads(line)["step"] for line in (tmp_path / "second" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5, 6]
