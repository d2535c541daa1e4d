"""The quick subset for iteration: ``python -m pytest -m quick`` runs in a few minutes what the whole suite runs in
half an hour: every test that took under ``QUICK_S`` seconds when last measured, and uses no shared fixture (one
of module or session scope) that took that long to set up.

``tests/durations.json`` holds what took longer: the tests (setup, call and teardown together, on 2 cores) and the
shared fixtures (``<where it is defined>::<name>``: its setup, which the first test using it pays), in seconds. A
test not listed counts as quick, so a new slow test joins the subset until the file is measured again:
``python -m pytest --record-durations`` (the whole suite, or any part of it: what it runs is updated, the rest
kept). A test marked ``slow`` is never quick, whatever its time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
QUICK_S = 0.5  # longer: out of the quick subset
_LISTED_S = 0.2  # shorter: not written to the file (it stays small)

_measured: dict[str, dict[str, float]] | None = None  # with --record-durations: this session's "tests", "fixtures"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations", action="store_true",
        help=f"write the times of the tests run, and of their shared fixtures, to tests/{DURATIONS.name} (for -m quick)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _measured
    _measured = {"tests": {}, "fixtures": {}} if config.getoption("--record-durations") else None


def _shared_fixtures(item: pytest.Item) -> Iterator[str]:
    """The keys of the module- and session-scoped fixtures ``item`` uses."""
    info = getattr(item, "_fixtureinfo", None)
    for name, definitions in (info.name2fixturedefs.items() if info is not None else ()):
        if definitions and definitions[-1].scope != "function":
            yield _key(definitions[-1])


def _key(fixturedef: pytest.FixtureDef) -> str:
    return f"{fixturedef.baseid}::{fixturedef.argname}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    durations = _read()
    tests, fixtures = durations["tests"], durations["fixtures"]
    for item in items:
        if item.get_closest_marker("slow") is not None or tests.get(item.nodeid, 0.0) >= QUICK_S:
            continue
        if all(fixtures.get(key, 0.0) < QUICK_S for key in _shared_fixtures(item)):
            item.add_marker(pytest.mark.quick)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest) -> Iterator[None]:
    start = time.perf_counter()
    yield
    if _measured is not None and fixturedef.scope != "function":
        key = _key(fixturedef)
        _measured["fixtures"][key] = max(_measured["fixtures"].get(key, 0.0), time.perf_counter() - start)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _measured is not None:
        tests = _measured["tests"]
        tests[report.nodeid] = tests.get(report.nodeid, 0.0) + report.duration  # setup, call and teardown


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if not _measured or not _measured["tests"]:
        return
    durations = _read()
    for kind, measured in _measured.items():
        for key, seconds in measured.items():
            durations[kind].pop(key, None)
            if seconds >= _LISTED_S:
                durations[kind][key] = round(seconds, 1)
    DURATIONS.write_text(json.dumps({kind: dict(sorted(found.items())) for kind, found in durations.items()},
                                    indent=1) + "\n")


def _read() -> dict[str, dict[str, float]]:
    durations = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    return {"tests": durations.get("tests", {}), "fixtures": durations.get("fixtures", {})}
