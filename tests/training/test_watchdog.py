"""The stuck-rank watchdog (toolkit.training.watchdog) on its own; across two "nodes" it is in test_multinode.py."""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from toolkit.training import watchdog
from toolkit.training.watchdog import Watchdog, progress, rank_watchdog

REPO = Path(__file__).resolve().parents[2]

# A process that reports progress for a while, then waits forever in a function whose name the stacks must show.
STUCK = textwrap.dedent("""
    import sys, time
    from toolkit.training.watchdog import Watchdog, progress

    def stuck_reading_a_sample():
        time.sleep(120)

    with Watchdog(sys.argv[1], rank=3, timeout_s=0.5, grace_s=0.3, poll_s=0.05):
        for step in range(1, 11):
            progress(f"step {step}")
            time.sleep(0.1)  # 10 beats 0.1 s apart: never 0.8 s without one
        stuck_reading_a_sample()
    print("not reached")
""")


def test_a_rank_without_progress_leaves_its_stacks_and_exits(tmp_path):
    error_file = tmp_path / "error.json"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", STUCK, str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO), "TORCHELASTIC_ERROR_FILE": str(error_file)},
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "not reached" not in result.stdout
    # 1 s of steps, 0.8 s of silence, the poll: far below the 120 s it would otherwise wait.
    assert elapsed < 30
    dump = tmp_path / "out" / "watchdog" / f"rank_3_{socket.gethostname()}.txt"
    text = dump.read_text()
    assert text.startswith(f"rank 3 on {socket.gethostname()} made no progress for ")
    assert "(dist_timeout_s 0.5; last: step 10)" in text.splitlines()[0]
    assert "stuck_reading_a_sample" in text and "tune-watchdog" not in text.splitlines()[0]
    assert f"watchdog: rank 3 on {socket.gethostname()} made no progress" in result.stderr
    # torchrun's launcher reads the reason from the worker's error file, in its record decorator's form.
    recorded = json.loads(error_file.read_text())["message"]["message"]
    assert recorded.startswith("RankStuck: rank 3 on ") and str(dump) in recorded


def test_progress_keeps_it_quiet_and_nothing_is_written(tmp_path):
    with Watchdog(tmp_path, rank=0, timeout_s=0.2, grace_s=0.1, poll_s=0.02) as dog:
        assert watchdog._active is dog
        for _ in range(30):  # 1.5 s in all, 5 times the limit, never 0.3 s without a beat
            progress("a micro-batch")
            time.sleep(0.05)
    assert watchdog._active is None
    progress("after")  # no watchdog: nothing to tell, no error
    assert not (tmp_path / "watchdog").exists()


def test_only_a_rank_of_several_processes_is_watched(tmp_path, monkeypatch):
    # One process has no peer waiting on it: a step longer than dist_timeout_s is no hang there.
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not isinstance(rank_watchdog(tmp_path, timeout_s=600), Watchdog)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    dog = rank_watchdog(tmp_path, timeout_s=600)
    assert isinstance(dog, Watchdog) and dog.rank == 2 and dog.timeout_s == 600
    assert dog.grace_s == watchdog.GRACE_S and dog.path == tmp_path / "watchdog" / f"rank_2_{socket.gethostname()}.txt"
