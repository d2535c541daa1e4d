"""Writing step checkpoints: everything a run needs to continue exactly, written by every rank in parallel into
``<output_dir>/checkpoints/step_<N>/`` (its files: :mod:`~toolkit.checkpoint.step_files`).

The marker is written last, atomically, once every rank's files are on disk: until then the folder is a draft that
resume ignores and pruning removes, and a failed write (a full disk, a read-only folder) removes it and leaves the
previous complete checkpoint as it was. Nothing here gathers the model on one rank, and nothing is written twice: a
replicated (DDP) model is saved once, its tensors spread over the ranks by DCP.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from toolkit.checkpoint.step_files import (
    BASE_FILES_DIR,
    CHECKPOINTS_DIR,
    COMPLETE_MARKER,
    TOKENIZER_FILES,
    TRAINER_STATE,
    TrainingState,
    _job_key,
    base_files_dir,
    checkpoint_step,
    is_complete,
    list_checkpoints,
    os_error_text,
    raise_on_every_rank,
    tensor_state,
)
from toolkit.checkpoint.step_reader import load_step_checkpoint
from toolkit.errors import UserError
from toolkit.parallel.distributed import shared_filesystem
from toolkit.training.debug import inject_fault
from toolkit.training.watchdog import progress

log = logging.getLogger(__name__)

# The run's copy of its base files (once per process, at its first save), hard-linked into each step_<N>/base_files.
_BASE_FILES_SNAPSHOT = ".base_files"
# A tokenizer is a few MB (Llama 3's tokenizer.json 9 MB, Gemma's 33 MB); what is larger is not metadata to copy.
MAX_BASE_FILE_BYTES = 50 * 2**20


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    return state


def _to_json(value: Any) -> Any:
    # torchao's optimizers keep the learning rate in a tensor, and so the LR scheduler's state holds tensors too: a
    # tensor is written as its values and dtype, and read back exactly by _from_json (float32 -> JSON -> float32).
    if isinstance(value, torch.Tensor):
        return {"tensor": value.tolist(), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, dict):
        return {key: _to_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(item) for item in value]
    return value


def _snapshot_base_files(base: Path, snapshot: Path) -> list[Path]:
    """Copy into ``snapshot`` the files of the base checkpoint ``base`` an export takes from it (``config.json``, the
    tokenizer and generation files), each at most :data:`MAX_BASE_FILE_BYTES`; a step checkpoint's are its own
    ``base_files``. Returns the copies (none: no snapshot folder either)."""
    source = base_files_dir(base) or base
    shutil.rmtree(snapshot, ignore_errors=True)  # a former launch's: its links in older checkpoints stay as they are
    snapshot.mkdir(parents=True)
    copies = []
    for name in ("config.json", *TOKENIZER_FILES):
        file = source / name
        if not file.is_file():
            continue
        size = file.stat().st_size
        if size > MAX_BASE_FILE_BYTES:
            log.warning(
                "%s: %d MB, too large to keep a copy in every step checkpoint's %s; tune export takes it from the "
                "base folder while that exists", file, size // 2**20, BASE_FILES_DIR,
            )
            continue
        shutil.copy2(file, snapshot / name)
        copies.append(snapshot / name)
    if not copies:
        snapshot.rmdir()
    return copies


def _link_or_copy(files: list[Path], folder: Path) -> None:
    # A hard link costs no time and no space; a filesystem without them (some FUSE mounts) gets a copy.
    folder.mkdir()
    for file in files:
        try:
            os.link(file, folder / file.name)
        except OSError:
            shutil.copy2(file, folder / file.name)


def _find_os_error(error: BaseException) -> OSError | None:
    """The OSError behind ``error``: itself, the first one a DCP ``CheckpointException`` gathered from the ranks,
    or one it was raised from; None when the failure is something else (a bug keeps its traceback)."""
    while error is not None:
        if isinstance(error, OSError):
            return error
        if isinstance(error, CheckpointException):
            for failure in error.failures.values():
                found = _find_os_error(failure[0] if isinstance(failure, tuple) else failure)
                if found is not None:
                    return found
        error = error.__cause__ or error.__context__
    return None


def write_failure(error: BaseException, folder: Path) -> OSError | None:
    """The OS's refusal behind ``error``, raised while writing into ``folder``, or None (a bug: it keeps its
    traceback).

    Besides :func:`_find_os_error`'s: torch's zip writer (``torch.save``, which DCP writes tensors with) reports a
    failed write as a ``RuntimeError`` ("unexpected pos ..."), its OSError lost once DCP has gathered the ranks'
    failures; when the filesystem is then full (under 1 MiB free), the disk is taken to be why.
    """
    found = _find_os_error(error)
    if found is not None or not isinstance(error, (RuntimeError, CheckpointException)):
        return found
    existing = Path(folder).absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        stats = os.statvfs(existing)
    except OSError:
        return None
    if stats.f_bavail * stats.f_frsize < 2**20:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _save_rng_state(file: Path) -> None:
    # Through a Python file: a failed write then carries its OSError (torch.save to a path reports only an iostream
    # error).
    with open(file, "wb") as f:
        torch.save(_rng_state(), f)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class StepCheckpointer:
    """Writes, prunes and loads a run's step checkpoints.

    Args:
        output_dir: the run's output folder; checkpoints go in ``<output_dir>/checkpoints/step_<N>/``.
        every_n_steps: save after every N optimizer steps and after the last; ``None`` never saves.
        keep_last_n: complete checkpoints to keep (older ones are deleted once a newer one is complete);
            ``None`` keeps all.
        async_save: write in the background while training goes on (the tensors are first copied to host
            memory); the next save, or :meth:`wait`, waits for it.
        trainable_only: save only the parameters that train (adapters); the frozen rest comes from the base
            checkpoint on resume.
        base_checkpoint: the run's base checkpoint folder (``checkpointer.checkpoint_dir``), if any. Every checkpoint
            keeps its ``config.json`` and tokenizer files in ``base_files/`` (written by rank zero, before the
            marker), so that ``tune export`` still knows the token ids and the tokenizer once the base is gone. They
            are copied from the base once, at the process's first save, and hard-linked into each checkpoint.
        data_parallel_size: the run's data-parallel ranks (default: every process), which the fp16 loss scale
            carries (a resume on another layout rescales it).
        recipe: the recipe writing them (``full_finetune``...), recorded so that another recipe cannot resume them.
        method: how the model trains (``full``, ``lora``, ``dora``, ``qlora``: see
            :func:`~toolkit.modules.peft.training_method`), recorded likewise.
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        every_n_steps: int | None,
        keep_last_n: int | None = None,
        async_save: bool = False,
        trainable_only: bool = False,
        base_checkpoint: str | Path | None = None,
        data_parallel_size: int | None = None,
        recipe: str | None = None,
        method: str | None = None,
    ) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise UserError(f"save_every_n_steps must be a positive number of steps or null, got {every_n_steps}")
        if keep_last_n is not None and keep_last_n < 1:
            raise UserError(f"keep_last_n must be at least 1 (or null to keep all), got {keep_last_n}")
        self.root = Path(output_dir) / CHECKPOINTS_DIR
        self.every_n_steps = every_n_steps
        self.keep_last_n = keep_last_n
        self.async_save = async_save
        self.trainable_only = trainable_only
        self.base_checkpoint = Path(base_checkpoint).expanduser() if base_checkpoint is not None else None
        self.recipe, self.method = recipe, method
        self._base_files: list[Path] | None = None  # rank 0: the snapshot's files, once taken
        # Checked in output_dir itself (the token file is removed again): nothing is created in checkpoints/ before
        # the recipe claims the folder, which a failure here must leave as it was.
        if every_n_steps is not None and not shared_filesystem(self.root.parent):
            raise UserError(
                f"save_every_n_steps: every rank writes its part of a step checkpoint into {self.root}, but that "
                "folder is not on a filesystem all nodes share; put output_dir on shared storage, or set "
                "save_every_n_steps=null"
            )
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.data_parallel_size = data_parallel_size or self.world_size
        self._pending: Future | None = None
        self._pending_path: Path | None = None
        self._finished: threading.Event | None = None  # rank 0: set once the marker of the pending save is written
        self._finish_error: str | None = None  # rank 0: why the pending save's marker could not be written
        # Background writes run collectives of their own: on a separate group they cannot interleave with training's.
        self._async_group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None

    def due(self, step: int, total_steps: int) -> bool:
        """Whether to save after ``step``."""
        return self.every_n_steps is not None and (step % self.every_n_steps == 0 or step == total_steps)

    # --- what goes in -----------------------------------------------------------------------------------------------

    def _trainer_state(self, step: int, state: TrainingState, strategy: str | None) -> dict[str, Any]:
        return {
            "step": step,
            "sampler": state.sampler.state_dict(),
            "lr_scheduler": _to_json(state.lr_scheduler.state_dict()),
            "grad_scaler": state.grad_scaler.state_dict() if state.grad_scaler is not None else None,
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "data_parallel": strategy,
            "model_state": "trainable" if self.trainable_only else "full",
            "recipe": self.recipe,
            "method": self.method,
        }

    # --- saving -----------------------------------------------------------------------------------------------------

    def save(self, step: int, state: TrainingState, *, config: DictConfig, strategy: str | None = None) -> Path:
        """Write ``step_<step>`` (a collective: every rank calls it). Returns its path.

        The marker is written once every rank's files are on disk; with ``async_save`` that happens in the
        background, and this returns as soon as the tensors are copied to host memory (a failure of the background
        write is raised by the next save, or by :meth:`wait`).

        Raises:
            UserError: the checkpoint could not be written (a full disk, a read-only folder...): its folder is
                removed, and the previous complete checkpoint stays as it was (pruning runs only once a newer one
                is complete).
        """
        self.wait()
        progress(f"saving step_{step}")  # (the recipe's next sign of life comes after the save)
        path = self.root / f"step_{step}"
        # Until its marker is written the folder is only a draft, ignored by resume and pruned: a failed save
        # removes it, and the complete checkpoints before it are not touched.
        error = None
        if self.rank == 0:
            error = self._written(path, lambda: self._write_trainer_files(path, step, state, config, strategy))
        self._fail_together(path, error)
        error = self._written(path, lambda: _save_rng_state(path / "rng" / f"rank_{self.rank}.pt"))
        self._fail_together(path, error)
        tensors = tensor_state(state, trainable_only=self.trainable_only)
        if self.async_save:
            self._pending = dcp.async_save(tensors, checkpoint_id=str(path), process_group=self._async_group)
            self._pending_path = path
            if self.rank == 0:
                finished = self._finished = threading.Event()

                def finish(future: Future) -> None:
                    try:
                        if future.exception() is None:  # else wait() raises it
                            self._finish_error = self._written(path, lambda: self._finish(path))
                    finally:
                        finished.set()

                self._pending.add_done_callback(finish)
        else:
            error = self._written(path, lambda: dcp.save(tensors, checkpoint_id=str(path)))
            # DCP's save returns (or fails) on every rank only after all of them wrote their files and rank 0 the
            # metadata.
            if error is None and self.rank == 0:
                error = self._written(path, lambda: self._finish(path))
            if error is not None:
                self._remove_draft(path)
                raise UserError(error)
        return path

    def _write_trainer_files(
        self, path: Path, step: int, state: TrainingState, config: DictConfig, strategy: str | None
    ) -> None:
        if path.exists():  # left by an attempt that died while writing it
            shutil.rmtree(path)
        (path / "rng").mkdir(parents=True)
        _write_atomically(path / TRAINER_STATE, json.dumps(self._trainer_state(step, state, strategy), indent=2))
        OmegaConf.save(config, path / "config.yaml")
        if self.base_checkpoint is not None:
            if self._base_files is None:
                self._base_files = _snapshot_base_files(self.base_checkpoint, self.root / _BASE_FILES_SNAPSHOT)
            if self._base_files:
                _link_or_copy(self._base_files, path / BASE_FILES_DIR)

    def _written(self, path: Path, write: Callable[[], Any]) -> str | None:
        """Run ``write``, part of saving the checkpoint ``path``: None if it succeeded, else the one-line message of
        the OS's refusal (a full disk, a read-only folder). Any other failure is a bug and raises as it is."""
        try:
            write()
            return None
        except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
            os_error = write_failure(e, path)
            if os_error is None:
                raise
        return self._failure_message(path, os_error)

    def _failure_message(self, path: Path, error: OSError) -> str:
        newest = next((p for p in reversed(list_checkpoints(self.root.parent)) if p != path), None)
        kept = f"the newest complete one, {newest}, is kept" if newest else "no earlier checkpoint was complete"
        return f"{path}: cannot write the step checkpoint ({os_error_text(error)}); {kept}"

    def _fail_together(self, path: Path, error: str | None) -> None:
        # A collective: if a rank failed, every rank raises its message and the draft goes.
        try:
            raise_on_every_rank(error)
        except UserError:
            self._remove_draft(path)
            raise

    def _remove_draft(self, path: Path) -> None:
        if self.rank == 0:  # an unfinished checkpoint (no marker), which may hold what filled the disk
            shutil.rmtree(path, ignore_errors=True)

    def _finish(self, path: Path) -> None:
        inject_fault("save", step=checkpoint_step(path), rank=self.rank)
        marker = {"step": checkpoint_step(path), "job": _job_key()}  # the job: see find_resume_checkpoint
        _write_atomically(path / COMPLETE_MARKER, json.dumps(marker) + "\n")
        self._prune(newest=path)

    def _prune(self, *, newest: Path) -> None:
        # Only ever called once ``newest`` is complete: until then every older checkpoint stays.
        newest_step = checkpoint_step(newest)
        for path in list_checkpoints(self.root.parent, complete_only=False):
            step = checkpoint_step(path)
            if step < newest_step and not is_complete(path):
                shutil.rmtree(path, ignore_errors=True)  # an older write that never finished
        if self.keep_last_n is not None:
            for path in list_checkpoints(self.root.parent)[: -self.keep_last_n]:
                shutil.rmtree(path, ignore_errors=True)

    def wait(self) -> None:
        """Block until a background save has finished (a no-op otherwise).

        Raises:
            UserError: the background write failed (see :meth:`save`), on every rank.
        """
        if self._pending is None:
            return
        pending, path, self._pending = self._pending, self._pending_path, None
        error = None
        try:
            pending.result()
        except (Exception, CheckpointException) as e:
            os_error = write_failure(e, path)
            if os_error is None:
                raise
            error = self._failure_message(path, os_error)
        # A future's result is visible before its callbacks have run: wait for the marker and pruning too.
        if self._finished is not None:
            self._finished.wait()
            self._finished = None
            error, self._finish_error = error or self._finish_error, None
        self._fail_together(path, error)

    # --- loading ----------------------------------------------------------------------------------------------------

    def load(self, path: str | Path, state: TrainingState, *, config: DictConfig) -> int:
        """Restore ``state`` from the checkpoint ``path``; returns its step. A collective: every rank calls it.

        See :func:`toolkit.checkpoint.step_reader.load_step_checkpoint`, which checks everything before it restores
        anything."""
        return load_step_checkpoint(
            path,
            state,
            config=config,
            trainable_only=self.trainable_only,
            rank=self.rank,
            data_parallel_size=self.data_parallel_size,
            recipe=self.recipe,
            method=self.method,
        )
