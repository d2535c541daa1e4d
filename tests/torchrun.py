"""Launching a test's worker script on several local processes with torchrun (gloo, CPU), bounded in time."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on now: the kernel picks one from the ephemeral range, which it hands out in turn,
    so a port just released is unlikely to be handed to another process in the next seconds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str | Path, *args: str, nproc: int = 2, timeout_s: float = 180) -> subprocess.CompletedProcess:
    """Run ``python script *args`` on ``nproc`` processes under ``torch.distributed.run`` on a free port.

    One thread per process (two processes share this machine's two cores); the repository first on the import path,
    so workers import this checkout's ``toolkit`` and ``tests``; output is captured. A worker that hangs fails the
    test after ``timeout_s`` (``subprocess.TimeoutExpired``) instead of stalling the suite.
    """
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_port", str(free_port()), str(script), *args],
        capture_output=True, text=True, timeout=timeout_s, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path},
    )
