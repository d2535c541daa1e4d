"""Running things from tests: the `tune` command in a subprocess and a worker script on several local processes
with torchrun (gloo, CPU), both bounded in time, and a recipe's ``main`` in the test's own process."""

import contextlib
import os
import runpy
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nothing listens on now: the kernel picks one from the ephemeral range, which it hands out in turn,
    so a port just released is unlikely to be handed to another process in the next seconds."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(
    script: str | Path, *args: str, nproc: int = 2, timeout_s: float = 180, env: dict[str, str] | None = None,
    per_rank_logs: bool = False, clean_for_retry: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python script *args`` on ``nproc`` processes under ``torch.distributed.run`` on a free port.

    The environment is :func:`_env`'s (``env`` added); output is captured. A worker that hangs fails the test after
    ``timeout_s`` (``subprocess.TimeoutExpired``) instead of stalling the suite.

    With ``per_rank_logs`` each rank's stdout and stderr are kept apart (torchrun's ``--redirects``) and the result's
    are the launcher's followed by each rank's in turn; a failed launch's stderr then ends with the last lines of
    every rank, so the crash of one rank is not hidden behind the traceback the others print when it goes (the end
    of ``stderr`` is what a test shows on failure).

    With ``clean_for_retry``, a launch that lost a rank to a signal below Python (:func:`crashed_ranks`: an abort or
    a segfault in gloo's or torch's C++, "malloc_consolidate(): unaligned fastbin chunk detected" and the like, seen
    about once in three runs of the whole suite on a busy machine, never in isolation) is launched once more from
    scratch, after ``clean_for_retry()`` removed what it wrote, and a warning says so, with the crashed launch's
    output in a file it names. A failure of the workers' own code (a Python exception: exit code 1) or a second crash
    still fails the test.
    """
    import tempfile
    import warnings

    def launch() -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                   "--master_port", str(free_port())]
        with tempfile.TemporaryDirectory(prefix="ranks-") as log_dir:
            flags = ["--log-dir", log_dir, "--redirects", "3"] if per_rank_logs else []
            result = subprocess.run([*command, *flags, str(script), *args], capture_output=True, text=True,
                                    timeout=timeout_s, env=_env(env))
            if per_rank_logs:
                _join_rank_logs(result, Path(log_dir), nproc)
        return result

    result = launch()
    crashed = crashed_ranks(result.stderr)
    if crashed and clean_for_retry is not None:
        with tempfile.NamedTemporaryFile("w", prefix="crashed-launch-", suffix=".log", delete=False) as log:
            log.write(result.stderr)
        clean_for_retry()
        warnings.warn(f"a launch of {Path(script).name} lost rank(s) {crashed} to a signal; launched again; the "
                      f"crashed launch's output is in {log.name}", stacklevel=2)
        result = launch()
    return result


def _join_rank_logs(result: subprocess.CompletedProcess, log_dir: Path, nproc: int, tail: int = 2400) -> None:
    """Append each rank's output from torchrun's ``log_dir`` (``<run>/attempt_<n>/<local rank>/std*.log``) to
    ``result``'s, headed by its rank; after a failure, ``stderr`` ends with the last ``tail // nproc`` characters of
    each rank's."""
    tails = []
    for stream in ("stdout", "stderr"):
        parts = [getattr(result, stream)]
        for rank in range(nproc):
            logs = sorted(log_dir.glob(f"*/attempt_*/{rank}/{stream}.log"))
            text = "".join(f.read_text(errors="replace") for f in logs)
            parts.append(f"\n---- rank {rank} {stream} ----\n{text}")
            if stream == "stderr" and result.returncode != 0:
                tails.append(f"\n---- rank {rank}, last lines ----\n{text[-(tail // nproc):]}")
        setattr(result, stream, "".join(parts + (tails if stream == "stderr" else [])))


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


@contextlib.contextmanager
def as_in_a_subprocess(env: dict[str, str] | None = None) -> Iterator[None]:
    """What a subprocess of :func:`run_tune` would have, for code run in this process meanwhile: ``env`` in the
    environment (and an empty ``TUNE_INJECT_FAULT`` unless given), and one thread for torch's kernels
    (``OMP_NUM_THREADS=1``): the same arithmetic, so that bitwise comparisons with runs in subprocesses hold, and
    no threads spinning for a core that another process holds (on a busy machine, two threads made a demo run ten
    times slower)."""
    import torch

    env = {"TUNE_INJECT_FAULT": "", **(env or {})}
    saved_env = {name: os.environ.get(name) for name in env}
    saved_threads = torch.get_num_threads()
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_recipe_here(recipe: str, config: str, *overrides: str) -> None:
    """``recipe``'s ``main`` on its ``config`` with ``overrides``, validated as `tune run` would, in this process
    (no interpreter start: faster than :func:`run_tune`), with one torch thread as in a subprocess."""
    from toolkit.config import apply_overrides, load_config, validate
    from toolkit.paths import configs_dir, recipes_dir

    cfg = load_config(configs_dir() / recipe / f"{config}.yaml")
    apply_overrides(cfg, list(overrides))
    validate(cfg)
    with as_in_a_subprocess():
        runpy.run_path(str(recipes_dir() / f"{recipe}.py"))["main"](cfg)


def run_tune_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tune *args`` in this process, for commands that start no other process (``tune run ..._single_device``,
    ``tune export``, ``tune plan``): the code path of the command itself (``tune run`` runs a one-device recipe in
    its own process), without an interpreter start and a torch import.

    As :func:`run_tune`'s subprocess would (see :func:`as_in_a_subprocess`): ``env``, one torch thread, stdout
    and stderr captured in files, Python's default warning filters with warnings printed to stderr, and records of
    ``logging`` at WARNING and above written to stderr as Python's last-resort handler writes them where no logging
    is configured (pytest's own handlers would otherwise take them). Returns the exit code and the captured output
    as a ``CompletedProcess``.
    """
    import faulthandler
    import logging
    import tempfile
    import warnings

    from toolkit.cli.main import main

    torchrun_flags = ("--nproc_per_node", "--nnodes", "--max_restarts", "--standalone", "--rdzv_backend")
    launches = args[:1] == ("run",) and any(
        a.endswith("_distributed") or a.split("=")[0] in torchrun_flags for a in args[1:]
    )
    assert not launches, "a launch starts processes: use run_tune"
    faulthandler_enabled = faulthandler.is_enabled()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        handler = logging.StreamHandler(stderr)
        handler.setLevel(logging.WARNING)

        def show(message, category, filename, lineno, file=None, line=None) -> None:
            stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

        logging.getLogger().addHandler(handler)
        try:
            with as_in_a_subprocess(env), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                    warnings.catch_warnings():
                warnings.resetwarnings()
                for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                    warnings.simplefilter("ignore", category)
                warnings.showwarning = show
                code = main(list(args))
        finally:
            logging.getLogger().removeHandler(handler)
            # torchrun's error recording points the fault handler at the recipe's stderr, a file closed below.
            if faulthandler_enabled and sys.__stderr__ is not None:
                faulthandler.enable(file=sys.__stderr__, all_threads=True)
            else:
                faulthandler.disable()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(["tune", *args], code, stdout.read(), stderr.read())


class RecipeRun:
    """One run for :func:`run_recipes`: ``tune run <recipe>_distributed --config <config> output_dir=<output_dir>
    <overrides>`` (``output_dir`` only for a recipe that reads it: the generate recipe writes nothing); its rank
    zero's stdout is kept next to ``output_dir`` (:meth:`stdout`)."""

    def __init__(self, recipe: str, output_dir: str | Path, *overrides: str, config: str = "demo") -> None:
        self.recipe, self.output_dir, self.overrides, self.config = recipe, Path(output_dir), list(overrides), config

    @property
    def stdout_file(self) -> Path:
        return self.output_dir.with_name(self.output_dir.name + ".stdout")

    def stdout(self) -> str:
        return self.stdout_file.read_text()


def run_recipes(
    runs: list[RecipeRun], *, nproc: int = 2, timeout_s: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``runs`` one after another in ONE launch of ``nproc`` processes (torchrun, gloo, CPU): each is
    configured and validated as `tune run` does it and runs the recipe's ``main``, in the same process group, so
    that the interpreters, imports and process-group set-up (most of a demo run's time) are paid once for all of
    them. A run that fails ends the launch (non-zero exit, its traceback in stderr). Rank zero's stdout of each run
    goes to its :meth:`RecipeRun.stdout` file; each run's time is printed to stderr. ``env`` is added to the
    workers' environment."""
    import json
    import tempfile

    for run in runs:
        run.output_dir.parent.mkdir(parents=True, exist_ok=True)
    spec = [
        {"recipe": r.recipe, "config": r.config, "output_dir": str(r.output_dir), "overrides": r.overrides,
         "stdout": str(r.stdout_file)}
        for r in runs
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=runs[0].output_dir.parent, delete=False) as f:
        json.dump(spec, f)

    def clean() -> None:
        import shutil

        for run in runs:
            shutil.rmtree(run.output_dir, ignore_errors=True)
            run.stdout_file.unlink(missing_ok=True)

    # A crash below Python: launched once more from scratch (see run_workers).
    return run_workers(REPO / "tests" / "_recipe_runs_worker.py", f.name, nproc=nproc, timeout_s=timeout_s, env=env,
                       per_rank_logs=True, clean_for_retry=clean)


def removing(path: Path) -> Callable[[], None]:
    """A ``clean_for_retry`` for :func:`run_workers`: what the workers wrote at ``path`` (a file, or a folder's
    contents) removed, the folder kept."""
    import shutil

    def remove() -> None:
        if path.is_dir():
            for child in path.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            path.unlink(missing_ok=True)

    return remove


def crashed_ranks(launcher_stderr: str) -> dict[int, int]:
    """The ranks that torchrun's failure summary says died of SIGABRT, SIGSEGV or SIGBUS (exit codes -6, -11,
    -7), with their exit codes; not those it stopped itself (SIGTERM) after another rank failed."""
    import re

    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n[^\n]*exitcode\s*:\s*(-?\d+)", launcher_stderr)
    return {int(rank): int(code) for rank, code in found if int(code) in (-6, -7, -11)}
