"""Debugging a multi-process run."""

import os
import pdb
import signal
import sys

from toolkit.errors import UserError
from toolkit.parallel.distributed import barrier


def breakpoint_on_rank(rank: int = 0, *, tty: str = "/dev/tty") -> None:
    """Stop rank ``rank`` in pdb while every other rank waits; the others resume when you ``continue``.

    Put ``breakpoint_on_rank(0)`` in a (copied) recipe where you want to look. torchrun's workers do not read the
    terminal on stdin, so the debugger talks to the controlling terminal (``tty``) directly. You land inside
    this function: ``up`` shows your code. The waiting ranks sit in a barrier bounded by the collective timeout
    (config ``dist_timeout_s``): raise it for a long session.

    Raises:
        UserError: no terminal to debug on (for example under a batch scheduler).
    """
    if int(os.environ.get("RANK", "0")) == rank:
        try:
            stdin, stdout = open(tty), open(tty, "w")
        except OSError:
            raise UserError(f"breakpoint_on_rank: no terminal at {tty} to debug rank {rank} on") from None
        debugger = pdb.Pdb(stdin=stdin, stdout=stdout)
        debugger.use_rawinput = False  # read commands from the terminal file, not from the process's stdin
        print(f"rank {rank} stopped in pdb; the other ranks wait. 'up' for your code, 'c' to go on.", file=stdout)
        debugger.set_trace(sys._getframe())
    barrier()


# Fault injection for recovery tests: "<point>:<step>[:<rank>]" makes that rank (default 0) SIGKILL itself at
# ``point`` of optimizer step ``step``, in the first attempt only (so that ``--max_restarts`` can recover).
FAULT_ENV = "TUNE_INJECT_FAULT"


def inject_fault(point: str, *, step: int, rank: int) -> None:
    """Die by SIGKILL here if ``$TUNE_INJECT_FAULT`` names this point, step and rank (a testing hook).

    Points: ``after_step`` (the step's update done, before the next) and ``save`` (a checkpoint's files written,
    its completion marker not yet). A real kill, not an exception: no ``finally`` block or handler runs.
    """
    spec = os.environ.get(FAULT_ENV)
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    want_point, want_step, *want_rank = spec.split(":")
    if want_point == point and int(want_step) == step and int(want_rank[0] if want_rank else 0) == rank:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
