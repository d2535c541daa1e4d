"""Debugging a multi-process run."""

import os
import pdb
import sys

from toolkit.errors import UserError
from toolkit.training.distributed import barrier


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
