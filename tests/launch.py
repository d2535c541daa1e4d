"""Running things from tests: the `tune` command in a subprocess and a worker script on several local processes
with torchrun (gloo, CPU), both bounded in time, and a recipe's ``main`` in the test's own process."""

import os
import runpy
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

    The environment is :func:`_env`'s; output is captured. A worker that hangs fails the test after ``timeout_s``
    (``subprocess.TimeoutExpired``) instead of stalling the suite.
    """
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_port", str(free_port()), str(script), *args],
        capture_output=True, text=True, timeout=timeout_s, env=_env(),
    )


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """One thread per process (two processes share this machine's two cores), and this checkout's ``toolkit`` and
    ``tests`` first on the import path."""
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path, **(extra or {})}


def run_tune(
    *args: str, timeout_s: float = 240, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess:
    """Run ``tune *args`` in a subprocess, output captured; ``env`` adds variables; with ``check``, a non-zero exit
    fails the test with the end of its stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "toolkit.cli.main", *args], capture_output=True, text=True, timeout=timeout_s,
        env=_env(env),
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def run_recipe_here(recipe: str, config: str, *overrides: str) -> None:
    """``recipe``'s ``main`` on its ``config`` with ``overrides``, validated as `tune run` would, in this process
    (no interpreter start: faster than :func:`run_tune`)."""
    from toolkit.config import apply_overrides, load_config, validate
    from toolkit.paths import configs_dir, recipes_dir

    cfg = load_config(configs_dir() / recipe / f"{config}.yaml")
    apply_overrides(cfg, list(overrides))
    validate(cfg)
    runpy.run_path(str(recipes_dir() / f"{recipe}.py"))["main"](cfg)
