"""tune run: resolution and validation before launch (in-process), one device and torchrun (subprocesses)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.cli.conftest import TUNE_COMMAND, one_line, tune_env


def test_single_device_runs_the_recipe_with_overrides(tune_process, tree) -> None:
    result = tune_process("run", "toy_single_device", "--config", "small", "message=hi there")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert tree.rank_files() == {"rank_none.txt": "none hi there"}


def test_recipe_file_and_config_file(tune_process, tree) -> None:
    shutil.copy(tree.recipes / "toy.py", tree.work / "mine.py")
    shutil.copy(tree.configs / "toy" / "small.yaml", tree.work / "mine.yaml")
    result = tune_process("run", "mine.py", "--config=mine.yaml", "message=copied")
    assert result.returncode == 0, result.stderr
    assert tree.rank_files() == {"rank_none.txt": "none copied"}


def test_validation_happens_before_launch(tune, tree) -> None:
    result = tune("run", "toy_single_device", "--config", "small", "optimizer.lrr=0.1")
    assert result.returncode == 2
    target = "tests.config._targets.fake_optimizer"
    assert one_line(result.stderr).endswith(f"optimizer.lrr: not an argument of {target}; did you mean 'lr'?")
    assert tree.rank_files() == {}


def test_a_new_key_the_recipe_never_reads_is_refused_before_launch(tune, tree) -> None:
    # `tune run` would otherwise run with `mesage` set and `message` unchanged.
    result = tune("run", "toy_single_device", "--config", "small", "mesage=hi")
    assert result.returncode == 2
    assert one_line(result.stderr).endswith("no key 'mesage' in the config, and recipe toy does not read one; "
                                            "did you mean 'message'?")
    assert tree.rank_files() == {}


def test_user_error_in_single_device_recipe(tune_process) -> None:
    result = tune_process("run", "toy_single_device", "--config", "small", "fail_on=all")
    assert result.returncode == 2
    assert one_line(result.stderr) == "tune: error: bad value on rank none"


def test_unknown_recipe(tune) -> None:
    result = tune("run", "tyo_distributed", "--config", "small")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: unknown recipe 'tyo_distributed'; did you mean 'toy_distributed'? (recipes: other, toy)"
    )


def test_a_typo_suggests_the_closest_runnable_name_launch_suffix_included(tune, tree) -> None:
    # A misspelt suffix: the distributed launch the user meant, not the bare recipe (which runs on one device).
    assert one_line(tune("run", "toy_distribted", "--config", "small").stderr).startswith(
        "tune: error: unknown recipe 'toy_distribted'; did you mean 'toy_distributed'?")
    assert "did you mean 'toy_single_device'?" in tune("run", "toy_single_devic", "--config", "small").stderr
    # A config's name where the recipe goes, and a recipe file that is not there.
    assert one_line(tune("run", "small", "--config", "small").stderr) == (
        "tune: error: 'small' is a config (of toy), not a recipe: give it after the recipe, e.g. "
        "`tune run toy_distributed --config small`"
    )
    shutil.copy(tree.recipes / "toy.py", tree.work / "mine.py")
    assert one_line(tune("run", "mien.py", "--config", "small").stderr) == (
        "tune: error: no such recipe file 'mien.py'; did you mean 'mine.py'?"
    )


def test_unknown_config(tune) -> None:
    result = tune("run", "toy_single_device", "--config", "smal")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: no config 'smal' for recipe 'toy'; did you mean 'small'? (its configs: demo, small)"
    )


def test_missing_config(tune) -> None:
    result = tune("run", "toy_single_device", "message=x")
    assert result.returncode == 2 and "missing --config" in one_line(result.stderr)


def test_torchrun_flags_need_distributed(tune, tree) -> None:
    result = tune("run", "--nproc_per_node", "2", "toy_single_device", "--config", "small")
    assert result.returncode == 2
    assert one_line(result.stderr) == (
        "tune: error: torchrun flags (--nproc_per_node 2) need a distributed launch: use toy_distributed"
    )
    assert tree.rank_files() == {}


def test_unknown_option(tune) -> None:
    result = tune("run", "toy_distributed", "--config", "small", "--nprocs", "2")
    assert result.returncode == 2
    assert "unknown option '--nprocs'" in one_line(result.stderr)


def test_distributed_runs_every_rank(tune_process, tree) -> None:
    result = tune_process("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small", "message=both")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # torchrun's banners stay quiet
    assert tree.rank_files() == {"rank_0.txt": "0 both", "rank_1.txt": "1 both"}


def test_torchrun_flags_may_follow_the_recipe(tune_process, tree) -> None:
    result = tune_process("run", "toy", "--nproc_per_node=2", "--config", "small")  # no suffix + flags: distributed
    assert result.returncode == 0, result.stderr
    assert sorted(tree.rank_files()) == ["rank_0.txt", "rank_1.txt"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU default")
def test_default_process_count_without_gpu(tune_process, tree) -> None:
    result = tune_process("run", "toy_distributed", "--config", "small")
    assert result.returncode == 0, result.stderr
    notice = one_line(result.stderr)
    assert notice.startswith("tune: no GPU found: ") and notice.endswith("(set --nproc_per_node to change)")
    count = int(notice.split("found: ")[1].split()[0])
    assert len(tree.rank_files()) == count


@pytest.mark.parametrize("fail_on", ["all", "1"])
def test_distributed_user_error_is_one_line_exit_2(tune_process, fail_on: str) -> None:
    # "1": only rank 1 hits the error and rank 0 is stopped by torchrun; the message must still show, once.
    result = tune_process("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small", f"fail_on={fail_on}")
    assert result.returncode == 2
    # With "all", whichever rank fails first makes torchrun stop the other, possibly before it records its own
    # error: either rank's message may be the one shown, but exactly one is.
    expected = {"tune: error: bad value on rank 0", "tune: error: bad value on rank 1"} if fail_on == "all" else {
        "tune: error: bad value on rank 1"
    }
    assert one_line(result.stderr) in expected


def test_distributed_crash_names_the_rank(tune_process) -> None:
    args = ("fail_on=1", "failure=bug")
    result = tune_process("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small", *args)
    assert result.returncode == 1
    assert "RuntimeError: bug on rank 1" in result.stderr  # the rank's own traceback
    summary = result.stderr.splitlines()[-1]
    # The summary names the rank, its exit code and its exception (from the error file the recipe recorded).
    assert summary.startswith("tune: error: rank 1 exited with code 1: RuntimeError: bug on rank 1 (error file: ")


def _failure(tmp_path, rank: int, exitcode: int, message: str | None, timestamp: int = 100):
    """A torchrun ProcessFailure, its error file written in the layout `record` uses (None: no file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error_{rank}.json"
    if message is not None:
        path.write_text(json.dumps(
            {"message": {"message": f"Traceback ...\n{message}", "extraInfo": {"timestamp": str(timestamp)}}}
        ))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_rank_that_crashed_is_named_before_the_ranks_that_lost_it(tmp_path, capsys) -> None:
    from toolkit.cli._run import _report_failure

    # Rank 1 raised and was still exiting when rank 0, whose collective lost its peer, failed and torchrun stopped
    # rank 1 with SIGTERM: rank 1 is the cause all the same, and is named first, though both carry one timestamp.
    failures = {
        0: _failure(tmp_path, 0, 1, "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
        1: _failure(tmp_path, 1, -signal.SIGTERM, "RuntimeError: injected failure on rank 1"),
        2: _failure(tmp_path, 2, -signal.SIGTERM, None),  # stopped while still working: not a cause
    }
    assert _report_failure(failures) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("tune: error: rank 1 failed, and was stopped by the launcher while exiting: "
                           "RuntimeError: injected failure on rank 1 (error file: ")
    assert "; rank 0 exited with code 1: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed" in line
    assert "rank 2" not in line


def test_ranks_stopped_without_an_error_of_their_own_are_named_as_killed(tmp_path, capsys) -> None:
    from toolkit.cli._run import _report_failure

    # Every rank was stopped by a signal from outside and none recorded an error: all are listed, as killed.
    assert _report_failure({0: _failure(tmp_path, 0, -signal.SIGTERM, None)}) == 1
    assert one_line(capsys.readouterr().err) == (
        "tune: error: rank 0 was killed by SIGTERM (error file: none written); see that rank's output above"
    )


def test_a_user_error_recorded_before_sigterm_is_shown(tmp_path, capsys) -> None:
    from toolkit.cli._run import _report_failure
    from toolkit.config._recipe import USER_ERROR_KEY

    stopped = _failure(tmp_path, 1, -signal.SIGTERM, "bad value")
    stopped.error_file_data[USER_ERROR_KEY] = "bad value on rank 1"
    assert _report_failure({0: _failure(tmp_path, 0, -signal.SIGTERM, None), 1: stopped}) == 2
    assert one_line(capsys.readouterr().err) == "tune: error: bad value on rank 1"


def test_a_timed_out_collective_names_the_ranks_still_running(tmp_path, capsys) -> None:
    from toolkit.cli._run import _report_failure

    # Rank 1 was stuck outside any collective (a data read that never returned): rank 0 timed out waiting for it,
    # and torchrun then stopped rank 1, which recorded nothing. The line named rank 0 alone, the one that waited.
    timed_out = "RuntimeError: [../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv"
    failures = {0: _failure(tmp_path, 0, 1, timed_out), 1: _failure(tmp_path, 1, -signal.SIGTERM, None)}
    assert _report_failure(failures) == 1
    line = one_line(capsys.readouterr().err)
    assert line.startswith("tune: error: rank 0 exited with code 1: " + timed_out)
    assert "a collective timed out: the rank it waited for is one of those still running when stopped (here: 1)" in line
    # A crash is not a timeout: the ranks stopped after it are not suspects.
    failures[0] = _failure(tmp_path, 0, 1, "RuntimeError: injected failure")
    assert _report_failure(failures) == 1
    assert "still running" not in one_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--nproc_per_node", "abc"],
            "--nproc_per_node must be a positive number or one of auto, cpu, gpu, xpu, got 'abc'",
        ),
        (["--nnodes", "1:2:3"], "--nnodes must be N or MIN:MAX, got '1:2:3'"),
    ],
)
def test_bad_torchrun_flags_are_one_line(tune, flags: list[str], message: str) -> None:
    result = tune("run", *flags, "toy_distributed", "--config", "small")
    assert result.returncode == 2
    assert one_line(result.stderr) == f"tune: error: {message}"


def test_no_recipe(tune) -> None:
    result = tune("run", "--nproc_per_node", "2")
    assert result.returncode == 2
    assert one_line(result.stderr) == "tune: error: no recipe given; see `tune run --help`"


def test_two_runs_at_once_do_not_collide(tree, tune_process) -> None:
    # Each single-node launch rendezvouses on its own free port, so neither waits for or joins the other.
    outs = [tree.out / f"run{i}" for i in range(2)]
    for out in outs:
        out.mkdir()
    with ThreadPoolExecutor(2) as pool:
        command = ("run", "--nproc_per_node", "2", "toy_distributed", "--config", "small")
        launches = [
            pool.submit(tune_process, *command, f"out_dir={out}", f"message=m{i}") for i, out in enumerate(outs)
        ]
        results = [launch.result() for launch in launches]
    assert [r.returncode for r in results] == [0, 0], [r.stderr for r in results]
    for i, out in enumerate(outs):
        assert sorted(p.read_text() for p in out.glob("rank_*.txt")) == [f"0 m{i}", f"1 m{i}"]


def test_ctrl_c_stops_every_process_quietly(tree) -> None:
    (tree.recipes / "sleepy.py").write_text(
        "import os, pathlib, time\nfrom toolkit.config import recipe_main\n\n"
        "@recipe_main\ndef main(cfg):\n    pathlib.Path(f\"ready_{os.environ['RANK']}\").touch()\n    time.sleep(60)\n\n"
        "if __name__ == '__main__':\n    main()\n"
    )
    (tree.configs / "sleepy").mkdir()
    (tree.configs / "sleepy" / "x.yaml").write_text("a: 1\n")
    command = [*TUNE_COMMAND, "run", "--nproc_per_node", "2", "sleepy_distributed", "--config", "x"]
    # Its own session, so that the interrupt goes to the launcher and its workers, as from a terminal.
    launcher = subprocess.Popen(
        command, cwd=tree.work, env=tune_env(tree), stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    # Interrupt once both workers are in the recipe: a Ctrl-C during Python's own start-up (slow on a loaded
    # machine) would interrupt an import, before any handler of ours exists.
    deadline = time.monotonic() + 90
    while not all((tree.work / f"ready_{rank}").exists() for rank in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    os.killpg(launcher.pid, signal.SIGINT)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 130
    assert stderr == ""
