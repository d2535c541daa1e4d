"""How many threads each CPU process of a run gets for torch's kernels, chosen by ``tune run`` before it starts them.

torch's default is one thread per core in every process; torchrun's, one per process when it starts several. Both
go wrong on a CPU run: two processes of two threads on two cores, or one process of two threads on a machine
whose other processes already hold a core, leave threads spinning for cores others hold (a demo evaluation took
113 s instead of 18 s). So the cores this process may use (its CPU affinity, and a container's CPU quota) that are
idle (less the 1-minute load average) are shared out evenly between the processes started here. A user's
``OMP_NUM_THREADS`` is kept. The run's header says the count; the launch itself stays quiet. The count does not
change the arithmetic of a step that matters here: the demo model's losses and gradients are bitwise equal on one
and two threads (checked in the tests).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

# The cgroup v2 file holding a container's CPU quota ("max 100000", or "200000 100000" for two CPUs).
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, within a container's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


@dataclass(frozen=True)
class ThreadChoice:
    """The threads per process, and what they were chosen from."""

    threads: int
    cores: int
    busy: int  # cores the load average says other processes hold
    processes: int


def choose_threads(processes: int, *, cores: int | None = None, load: float | None = None) -> ThreadChoice:
    """An even share of the idle usable cores for each of ``processes`` processes, at least one thread each.

    Args:
        processes: the processes that will run on this machine.
        cores: the usable cores (default: :func:`usable_cores`).
        load: the 1-minute load average (default: the system's), whose whole part counts the busy cores.
    """
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available on this system
            load = 0.0
    busy = min(cores - 1, max(0, math.floor(load)))  # a core's worth of load, not the tail of a finished run
    return ThreadChoice(threads=max(1, (cores - busy) // max(1, processes)), cores=cores, busy=busy,
                        processes=processes)
