"""The quick subset (tests/conftest.py): a test is quick when it was measured under QUICK_S, is not marked slow, and
uses no shared fixture that was measured slower; what --record-durations writes is read back the same."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tests import conftest


@dataclass
class FakeItem:
    nodeid: str
    fixtures: dict[str, str] = field(default_factory=dict)  # name -> scope
    slow: bool = False
    added: list = field(default_factory=list)

    @property
    def _fixtureinfo(self):
        defs = {name: [SimpleNamespace(scope=scope, baseid="tests/x", argname=name)]
                for name, scope in self.fixtures.items()}
        return SimpleNamespace(name2fixturedefs=defs)

    def get_closest_marker(self, name):
        return object() if name == "slow" and self.slow else None

    def add_marker(self, marker):
        self.added.append(marker.name)


def test_quick_means_measured_fast_not_slow_and_no_costly_shared_fixture(tmp_path, monkeypatch):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"tests": {"t::long": 3.0, "t::short": 0.3},
                                     "fixtures": {"tests/x::launch": 40.0, "tests/x::folder": 0.2}}))
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    items = [FakeItem("t::long"), FakeItem("t::short"), FakeItem("t::new"), FakeItem("t::marked", slow=True),
             FakeItem("t::shares", {"launch": "module"}), FakeItem("t::cheap_fixture", {"folder": "session"}),
             FakeItem("t::own_fixture", {"launch": "function"})]
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.nodeid for item in items if item.added == ["quick"]] == [
        "t::short", "t::new", "t::cheap_fixture", "t::own_fixture"]


def test_recording_updates_what_ran_and_keeps_the_rest(tmp_path, monkeypatch):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"tests": {"t::kept": 2.0, "t::faster_now": 5.0}, "fixtures": {}}))
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    monkeypatch.setattr(conftest, "_measured", {"tests": {"t::faster_now": 0.01, "t::new": 1.234},
                                                "fixtures": {"tests/x::launch": 12.0}})
    conftest.pytest_sessionfinish(None, 0)
    assert json.loads(durations.read_text()) == {"tests": {"t::kept": 2.0, "t::new": 1.2},
                                                 "fixtures": {"tests/x::launch": 12.0}}


def test_the_shipped_times_are_well_formed():
    shipped = json.loads(conftest.DURATIONS.read_text())
    assert set(shipped) == {"tests", "fixtures"}
    for kind in shipped.values():
        assert all(isinstance(s, (int, float)) and s >= conftest._LISTED_S for s in kind.values())
    assert all("::" in key for kind in shipped.values() for key in kind)


@pytest.mark.parametrize("name", ["quick", "slow"])
def test_the_markers_are_registered(pytestconfig, name):
    assert any(line.startswith(f"{name}:") for line in pytestconfig.getini("markers"))
