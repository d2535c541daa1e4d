"""The test launcher itself (tests/launch.py): a rank that crashes below Python is named, and its own output is
what a failed launch's stderr ends with, not the traceback the surviving ranks print when it goes."""

from tests.launch import REPO, crashed_ranks, run_workers


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
