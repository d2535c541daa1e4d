"""A pytest plugin for run_checks.py: each test's outcome and seconds as it ends, and a failure's traceback at once
rather than in pytest's summary at the end, so that a run cut short by its time limit still says what failed and
why (``pytest -p report_each_test`` with this folder on ``PYTHONPATH``)."""

from __future__ import annotations


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" or report.outcome != "passed":  # setup and teardown only when they fail (or skip)
        print(f"\n[test] {report.nodeid} {report.when}: {report.outcome} in {report.duration:.1f} s", flush=True)
        if report.failed:
            print(report.longreprtext, flush=True)
