"""The test launcher itself (tests/launch.py): a rank that crashes below Python is named, and its own output is
what a failed launch's stderr ends with, not the traceback the surviving ranks print when it goes."""

import pytest

from tests.launch import REPO, crashed_ranks, removing, run_workers


def test_a_crashed_rank_is_named_and_its_output_ends_stderr():
    result = run_workers(REPO / "tests" / "_crash_worker.py", nproc=2, timeout_s=120, per_rank_logs=True)
    assert result.returncode != 0
    assert crashed_ranks(result.stderr) == {1: -6}
    tail = result.stderr[-2400:]
    assert "---- rank 0, last lines ----" in tail and "---- rank 1, last lines ----" in tail
    rank_1 = tail.split("---- rank 1, last lines ----")[1]
    assert "rank 1 up" in rank_1 and "Fatal Python error: Aborted" in rank_1  # faulthandler's report of the abort
    assert "rank 0 up" in result.stderr.split("---- rank 0 stderr ----")[1]


def test_ranks_stopped_by_the_launcher_are_not_crashes():
    summary = """
  [1]:
    rank      : 1 (local_rank: 1)
    exitcode  : -15 (pid: 2)  (SIGTERM)
  Root Cause (first observed failure):
  [0]:
    rank      : 0 (local_rank: 0)
    exitcode  : 1 (pid: 1)
"""
    assert crashed_ranks(summary) == {}
    assert crashed_ranks(summary.replace("-15 (pid: 2)  (SIGTERM)", "-11 (pid: 2)  (SIGSEGV)")) == {1: -11}


def test_a_launch_that_lost_a_rank_to_a_signal_is_launched_once_more_after_cleaning(tmp_path):
    (tmp_path / "written").mkdir()
    (tmp_path / "written" / "part.json").write_text("{}")
    (tmp_path / "result.json").write_text("{}")
    cleaned = []

    def clean() -> None:
        removing(tmp_path / "written")()
        removing(tmp_path / "result.json")()
        cleaned.append(True)

    with pytest.warns(UserWarning, match=r"_crash_worker.py lost rank\(s\) \{1: -6\} to a signal; launched again"):
        result = run_workers(REPO / "tests" / "_crash_worker.py", nproc=2, timeout_s=120, clean_for_retry=clean)
    # Cleaned once, before the second launch; the worker crashes every time, so the second crash still fails.
    assert cleaned == [True] and result.returncode != 0 and crashed_ranks(result.stderr) == {1: -6}
    assert (tmp_path / "written").is_dir() and not any((tmp_path / "written").iterdir())
    assert not (tmp_path / "result.json").exists()
