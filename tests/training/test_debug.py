"""The breakpoint helper stops only the chosen rank, on the terminal it is given."""

import pytest

from toolkit.errors import UserError
from toolkit.training import debug


class RecordingPdb:
    """Stands in for pdb.Pdb: records that a session started and with which terminal streams."""

    sessions: list = []

    def __init__(self, stdin, stdout):
        self.stdin, self.stdout = stdin, stdout

    def set_trace(self, frame):
        RecordingPdb.sessions.append((self.stdin.name, frame.f_code.co_name))


def test_only_the_chosen_rank_enters_the_debugger(monkeypatch, tmp_path):
    terminal = tmp_path / "tty"
    terminal.write_text("")
    monkeypatch.setattr(debug.pdb, "Pdb", RecordingPdb)
    RecordingPdb.sessions = []
    monkeypatch.setenv("RANK", "1")
    debug.breakpoint_on_rank(0, tty=str(terminal))
    assert RecordingPdb.sessions == []
    monkeypatch.setenv("RANK", "0")
    debug.breakpoint_on_rank(0, tty=str(terminal))
    assert RecordingPdb.sessions == [(str(terminal), "breakpoint_on_rank")]


def test_no_terminal_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UserError, match="no terminal"):
        debug.breakpoint_on_rank(0, tty=str(tmp_path / "missing"))
