"""A stuck-rank watchdog: a rank that makes no progress for ``dist_timeout_s`` leaves its stacks and ends.

A collective that waits past ``dist_timeout_s`` raises on the ranks that wait, but the rank they wait for may be
stuck elsewhere: in data loading, in a read from a hung filesystem, in a deadlock of its own. On one node torchrun
then stops it with the others; on several, its node's launcher knew nothing of the failure and kept it (and the
job) alive. So every rank of a multi-process run keeps a :class:`Watchdog`: the training loop reports progress
(:func:`progress`, each micro-batch, validation batch and checkpoint), and a rank that reports none for
``timeout_s`` plus :data:`GRACE_S` writes every thread's Python stack to
``<output_dir>/watchdog/rank_<rank>_<host>.txt``, records the reason in torchrun's error file (the line ``tune run``
prints), and exits with code 1. Its launcher then ends the job on every node, or restarts it (``--max_restarts``),
and the run resumes from its last step checkpoint.

The grace period lets the ranks that wait in a collective fail first, with the collective's own message; the
watchdog catches the rank they waited for. The check is a Python thread, which cannot run while a C call holds the
interpreter lock; as a backstop, ``faulthandler`` (a C thread) dumps the stacks to stderr and exits
:data:`BACKSTOP_S` later if the Python thread stops checking.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

# Seconds past the timeout before the watchdog acts: collectives time out at the timeout itself and say more.
GRACE_S = 10.0
# Seconds past that again for faulthandler's backstop (a hang holding the interpreter lock stops the Python check).
BACKSTOP_S = 60.0
DUMP_DIR = "watchdog"

_active: Watchdog | None = None


def progress(what: str) -> None:
    """Tell this process's watchdog, if one runs, that the run moved on (``what``: where, for its report)."""
    if _active is not None:
        _active.beat(what)


class Watchdog:
    """Ends this process if :meth:`beat` is not called for ``timeout_s`` + ``grace_s`` seconds, leaving every
    thread's stack in ``output_dir/watchdog``; it checks every ``poll_s`` seconds. A context manager: it watches from
    ``__enter__`` to ``__exit__``."""

    def __init__(
        self, output_dir: str | Path, *, rank: int, timeout_s: float, grace_s: float = GRACE_S, poll_s: float = 1.0
    ) -> None:
        self.folder = Path(output_dir).expanduser() / DUMP_DIR
        self.rank, self.host = rank, socket.gethostname()
        self.timeout_s, self.grace_s, self.poll_s = float(timeout_s), grace_s, poll_s
        self._last, self._what = time.monotonic(), "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tune-watchdog", daemon=True)

    @property
    def path(self) -> Path:
        """Where the stacks go if it fires (nothing is written before)."""
        return self.folder / f"rank_{self.rank}_{self.host}.txt"

    def beat(self, what: str) -> None:
        self._last, self._what = time.monotonic(), what

    def __enter__(self) -> Watchdog:
        global _active
        self.beat("start")
        _active = self
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        global _active
        _active = None
        self._stop.set()
        self._thread.join()
        faulthandler.cancel_dump_traceback_later()

    def _watch(self) -> None:
        limit = self.timeout_s + self.grace_s
        armed_for = None  # the beat the backstop's deadline was set from
        while not self._stop.wait(self.poll_s):
            last = self._last
            idle = time.monotonic() - last
            if idle > limit:
                self._fire(idle)
            # Moved with each beat while this thread runs; fires only if it stops running (the interpreter lock
            # held). Without a new beat its deadline stands, so it is not set again (each setting starts a thread).
            if last != armed_for:
                faulthandler.dump_traceback_later(limit - idle + BACKSTOP_S, exit=True, file=sys.stderr)
                armed_for = last

    def _fire(self, idle: float) -> None:
        message = (f"rank {self.rank} on {self.host} made no progress for {idle:.0f} s (dist_timeout_s "
                   f"{self.timeout_s:g}; last: {self._what}); every thread's stack: {self.path}")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with self.path.open("w") as f:
                f.write(f"{message}\n\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:  # no writable output folder: the stacks go to stderr instead
            message += f" (not written: {e.strerror or e}; on stderr instead)"
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        print(f"watchdog: {message}", file=sys.stderr, flush=True)
        _record_for_launcher(message)
        sys.stdout.flush()
        os._exit(1)


def _record_for_launcher(message: str) -> None:
    """Write ``message`` where torchrun's launcher reads a failed worker's error (its error file), in the form its
    ``record`` decorator uses, so that ``tune run``'s closing line names the stuck rank and the stacks' file."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    error = {"message": {"message": f"RankStuck: {message}",
                         "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(error, f)
    except OSError:
        pass


def rank_watchdog(output_dir: str | Path, *, timeout_s: float) -> Watchdog | contextlib.nullcontext:
    """The watchdog of this process when it is one rank of several (torchrun's ``WORLD_SIZE`` above 1), else a
    context that does nothing: one process has no peer waiting on it, and a long step is then no hang."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return contextlib.nullcontext()
    return Watchdog(output_dir, rank=int(os.environ.get("RANK", "0")), timeout_s=timeout_s)
