"""Step checkpoints: everything a run needs to continue exactly, written by every rank in parallel.

``<output_dir>/checkpoints/step_<N>/`` holds:

=========================  ============================================================================
``.metadata``, ``*.distcp``  ``torch.distributed.checkpoint`` (DCP): the model (or only its trainable part) and
                           the optimizer state, each rank writing its own shard; keys are parameter names, so
                           any world size and any data-parallel strategy can load them (DCP reshards).
``trainer_state.json``     step, data position, LR schedule, loss scale, and what wrote it.
``rng/rank_<r>.pt``        each rank's RNG states (Python, NumPy, torch CPU, CUDA).
``config.yaml``            the config of the run that wrote it.
``base_files/``            the base checkpoint's ``config.json`` and tokenizer files, so the checkpoint exports
                           alone (token ids, context length, tokenizer) once the base folder is gone.
``COMPLETE``               written last, atomically: a folder without it is ignored by resume and pruned.
=========================  ============================================================================

Nothing here gathers the model on one rank, and nothing is written twice: a replicated (DDP) model is saved once,
its tensors spread over the ranks by DCP.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from toolkit.data import GlobalBatchSampler
from toolkit.errors import UserError
from toolkit.training.debug import inject_fault
from toolkit.training.distributed import shared_filesystem
from toolkit.training.optim import OptimizerInBackward
from toolkit.training.watchdog import progress
from toolkit.parallel import is_zero_redundancy
from toolkit.training.safe_load import (
    RefusedPickle,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
    torch_load,
)

log = logging.getLogger(__name__)
# One process without a process group loads and saves alone, as intended: DCP's warning says only that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

CHECKPOINTS_DIR = "checkpoints"
COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
BASE_FILES_DIR = "base_files"
# The run's copy of its base files (once per process, at its first save), hard-linked into each step_<N>/base_files.
_BASE_FILES_SNAPSHOT = ".base_files"
# A tokenizer is a few MB (Llama 3's tokenizer.json 9 MB, Gemma's 33 MB); what is larger is not metadata to copy.
MAX_BASE_FILE_BYTES = 50 * 2**20
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Copied from the source checkpoint into an export when there: the tokenizer (fast or slow, and the chat template,
# which transformers keeps in its own file) and the generation settings.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
# Config sections a checkpoint's tensors depend on: resuming with any of them changed is refused. A checkpoint of
# the trainable part only also depends on the frozen base it was trained on.
_MUST_MATCH = ("model",)
_MUST_MATCH_TRAINABLE_ONLY = ("model", "checkpointer", "seed")


@dataclass
class TrainingState:
    """The objects a step checkpoint saves and restores (``grad_scaler`` only for fp16)."""

    model: nn.Module
    optimizer: Optimizer
    lr_scheduler: Any
    sampler: GlobalBatchSampler
    grad_scaler: torch.amp.GradScaler | None = None


def checkpoint_step(path: Path) -> int:
    """``N`` of a ``step_<N>`` folder."""
    match = _STEP_DIR.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path} is not a step_<N> folder")
    return int(match.group(1))


def is_complete(path: Path) -> bool:
    """Whether every rank finished writing ``path`` (its marker exists)."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def list_checkpoints(output_dir: str | Path, *, complete_only: bool = True) -> list[Path]:
    """The run's ``step_<N>`` folders, oldest first; by default only complete ones."""
    root = Path(output_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    if complete_only:
        found = [p for p in found if is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete step checkpoint in ``output_dir``, or None."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def restart_count() -> int:
    """How many times torchrun has restarted this job's workers (``--max_restarts``); 0 outside torchrun."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _job_key() -> str:
    # The same across torchrun's restarts of one job, different for another job: its rendezvous id, or the
    # launcher's process (torchrun's default id "none" is shared by every job).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return run_id if run_id != "none" else f"agent-{os.getppid()}"


def find_resume_checkpoint(resume_from: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start.

    ``resume_from`` is ``None`` (start fresh), ``auto`` (the newest complete checkpoint in ``output_dir``, or a fresh
    start when there is none) or a ``step_<N>`` folder. Workers restarted by torchrun (``--max_restarts``) resume
    from the newest complete checkpoint in ``output_dir`` whatever the config says: that is how a run recovers from
    a dead rank, losing only the steps since. A run started from a ``step_<N>`` folder goes back to that folder only
    while its own job has completed no checkpoint of its own (older ones in ``output_dir``, of another run, are not
    its own); on a first launch, the folder is always what it means.

    Raises:
        UserError: ``resume_from`` names a folder that is missing or not a complete checkpoint.
    """
    restarts = restart_count()
    if restarts > 0 and resume_from not in (None, "auto"):
        own = next((p for p in reversed(list_checkpoints(output_dir)) if _written_by_this_job(p)), None)
        if own is not None:
            log.warning(
                "restart %d: resuming from %s, the newest checkpoint this run completed, not from resume_from=%s, "
                "where it started",
                restarts, own, resume_from,
            )
            return own
        log.warning(
            "restart %d: resuming from resume_from=%s again: this run completed no checkpoint since it started there",
            restarts, resume_from,
        )
    elif restarts > 0:
        newest = latest_checkpoint(output_dir)
        if newest is not None:
            log.warning("restart %d: resuming from %s, the newest complete checkpoint in output_dir", restarts, newest)
        else:
            log.warning("restart %d: no complete checkpoint in %s yet: starting from the beginning", restarts, output_dir)
        return newest
    if resume_from is None:
        return None
    if resume_from == "auto":
        return latest_checkpoint(output_dir)
    path = Path(resume_from).expanduser()
    if not path.is_dir():
        raise UserError(f"resume_from: {path} is not a folder (use auto, or a {CHECKPOINTS_DIR}/step_<N> folder)")
    if not is_complete(path):
        newest = latest_checkpoint(path.parent.parent) if _STEP_DIR.match(path.name) else None
        hint = f"; the newest complete one is {newest}" if newest else ""
        raise UserError(
            f"resume_from: {path} is not a complete checkpoint (no {COMPLETE_MARKER} marker: its writing was "
            f"interrupted, or it is not a step checkpoint){hint}"
        )
    return path


def _written_by_this_job(path: Path) -> bool:
    # The marker names the job that completed the checkpoint (_job_key: the same across torchrun's restarts).
    try:
        return json.loads((path / COMPLETE_MARKER).read_text()).get("job") == _job_key()
    except (OSError, ValueError, AttributeError):
        return False


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


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


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


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if value.keys() == {"tensor", "dtype"}:
            return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
        return {key: _from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def base_files_dir(checkpoint: str | Path) -> Path | None:
    """The ``base_files`` folder of the step checkpoint ``checkpoint`` (the base's ``config.json`` and tokenizer
    files, as the run had them), or None: not a step checkpoint, or one written before they were kept."""
    folder = Path(checkpoint) / BASE_FILES_DIR
    return folder if folder.is_dir() and (Path(checkpoint) / ".metadata").is_file() else None


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


def os_error_text(error: OSError) -> str:
    """An OS error as its code and text, e.g. ``ENOSPC: No space left on device``, for a one-line message."""
    code = errno.errorcode.get(error.errno) if error.errno else None
    text = error.strerror or str(error) or type(error).__name__
    return f"{code}: {text}" if code else text


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


def raise_on_every_rank(error: str | None) -> None:
    """Raise the first failed rank's ``error`` as a UserError on every rank, or return on all when none failed.

    A collective (every rank calls it): a rank whose write failed then never leaves the others waiting in a
    collective it does not reach.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e is not None), None)
    if error is not None:
        raise UserError(error)


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

    def _options(self, **kwargs) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.trainable_only, **kwargs)

    @staticmethod
    def _local_optimizers(optimizer: Optimizer) -> Optimizer | tuple[Optimizer, ...]:
        # ZeRO-1 keeps the state of this rank's parameters in an inner optimizer, the step inside backward one
        # optimizer per parameter; saved by parameter name, their state is that of one optimizer over all
        # parameters, and reshards to any world size like the rest.
        if is_zero_redundancy(optimizer):
            return optimizer.optim
        if isinstance(optimizer, OptimizerInBackward):
            return tuple(optimizer.optimizers.values())
        return optimizer

    def _tensor_state(self, state: TrainingState) -> dict[str, Any]:
        optimizer = self._local_optimizers(state.optimizer)
        return {
            "model": get_model_state_dict(state.model, options=self._options()),
            "optimizer": get_optimizer_state_dict(
                state.model, optimizer, options=self._options(flatten_optimizer_state_dict=True)
            ),
        }

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
        tensors = self._tensor_state(state)
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

        Everything is checked before anything is restored: the marker, the config, the files' sizes, and every key
        and shape against this model and optimizer.

        Raises:
            UserError: an incomplete, truncated or corrupt checkpoint, one of another model, or one whose config
                is incompatible; the message names the file and the key.
        """
        path = Path(path)
        if not is_complete(path):
            raise UserError(f"{path}: not a complete checkpoint (no {COMPLETE_MARKER} marker)")
        trainer = _read_trainer_state(path)
        _check_config(path, config, _MUST_MATCH_TRAINABLE_ONLY if self.trainable_only else _MUST_MATCH)
        if trainer["model_state"] != ("trainable" if self.trainable_only else "full"):
            raise UserError(
                f"{path / TRAINER_STATE}: holds the {trainer['model_state']} model, but this recipe saves the "
                f"{'trainable' if self.trainable_only else 'full'} one; resume with the recipe that wrote it"
            )
        tensors = self._tensor_state(state)
        _check_tensors(path, tensors)
        load_dcp(tensors, path)
        set_model_state_dict(state.model, tensors["model"], options=self._options(strict=not self.trainable_only))
        set_optimizer_state_dict(
            state.model,
            self._local_optimizers(state.optimizer),
            tensors["optimizer"],
            options=self._options(flatten_optimizer_state_dict=True),
        )
        state.lr_scheduler.load_state_dict(_from_json(trainer["lr_scheduler"]))
        # The optimizer's own copy of the learning rate (ZeRO-1's outer one is not in its state) is the schedule's.
        for group, lr in zip(state.optimizer.param_groups, state.lr_scheduler.get_last_lr()):
            if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers need it to stay the same tensor
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        state.sampler.load_state_dict(trainer["sampler"])
        if state.grad_scaler is not None and trainer["grad_scaler"]:
            scaler = dict(trainer["grad_scaler"])
            # The scale is per rank's loss, which carries the data-parallel size (see make_grad_scaler): on another
            # number of processes the same effective scale is this one times old / new.
            saved = trainer.get("data_parallel_size", trainer["world_size"])  # (checkpoints before TP: the same)
            scaler["scale"] = scaler["scale"] * saved / self.data_parallel_size
            state.grad_scaler.load_state_dict(scaler)
        rng_file = path / "rng" / f"rank_{self.rank % trainer['world_size']}.pt"
        try:
            _set_rng_state(torch_load(rng_file))
        except RefusedPickle as e:
            raise UserError(str(e)) from None
        except Exception as e:
            raise UserError(f"{rng_file}: cannot read the RNG state ({_first_line(e)})") from None
        return int(trainer["step"])


def load_dcp(state_dict: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` of ``state_dict`` from the checkpoint folder ``path`` (``kwargs``: ``no_dist``...), reading
    nothing that could run code (see :mod:`toolkit.training.safe_load`), where a failure to read it is one line
    naming the folder, or the file that holds more than a checkpoint does.

    Raises:
        UserError: a file could not be read, or was refused (DCP's own exception, which wraps every rank's
            failure, is a BaseException: ``except Exception`` alone lets it through as a traceback).
    """
    try:
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), **kwargs)
    except (Exception, CheckpointException) as e:
        if (refused := _refused_pickle(e)) is not None:
            raise UserError(str(refused)) from None
        raise UserError(f"{path}: cannot read the checkpoint ({_read_error(e)}); a file may be corrupt") from None


def _refused_pickle(error: BaseException) -> RefusedPickle | None:
    """The refusal behind ``error`` (DCP's exception wraps each rank's own), if a file was refused."""
    if isinstance(error, CheckpointException):
        inner = [e[0] if isinstance(e, tuple) else e for e in error.failures.values()]
        return next((e for e in inner if isinstance(e, RefusedPickle)), None)
    return error if isinstance(error, RefusedPickle) else None


def _read_error(error: BaseException) -> str:
    """Why reading a checkpoint failed, in a few words: for DCP's exception, the kind of the first rank's own error
    (an unpickling error's text is torch.load's advice to load untrusted files with weights_only=False: not for a
    corrupt checkpoint)."""
    if isinstance(error, CheckpointException) and error.failures:
        inner = next(iter(error.failures.values()))
        return f"{type(inner[0] if isinstance(inner, tuple) else inner).__name__} reading its tensors"
    return _first_line(error)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _read_trainer_state(path: Path) -> dict[str, Any]:
    file = path / TRAINER_STATE
    try:
        trainer = json.loads(file.read_text())
        for key in ("step", "sampler", "lr_scheduler", "world_size", "model_state"):
            trainer[key]
    except FileNotFoundError:
        raise UserError(f"{file}: missing; {path} is not a step checkpoint") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{file}: unreadable or incomplete ({e}); the checkpoint is corrupt") from None
    return trainer


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: node}


def _check_config(path: Path, config: DictConfig, sections: tuple[str, ...]) -> None:
    file = path / "config.yaml"
    try:
        saved = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except FileNotFoundError:
        raise UserError(f"{file}: missing; {path} is not a step checkpoint") from None
    except Exception as e:
        raise UserError(f"{file}: unreadable ({_first_line(e)})") from None
    current = OmegaConf.to_container(config, resolve=True)
    for section in sections:
        old, new = _flatten(saved.get(section), section), _flatten(current.get(section), section)
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key):
                raise UserError(
                    f"{file}: the checkpoint was trained with {key}={old.get(key)!r}, this run has "
                    f"{key}={new.get(key)!r}; resume with the same {section} or start a new run"
                )


def _check_tensors(path: Path, tensors: dict[str, Any]) -> Metadata:
    """The checkpoint's metadata, once every file it indexes is whole (by size) and every tensor of ``tensors`` is
    in it with its shape."""
    metadata_file = path / ".metadata"
    try:
        metadata = read_dcp_metadata(path)
    except FileNotFoundError:
        raise UserError(f"{metadata_file}: missing; the checkpoint is incomplete") from None
    except RefusedPickle as e:
        raise UserError(str(e)) from None
    except Exception as e:
        raise UserError(f"{metadata_file}: unreadable ({_first_line(e)}); the checkpoint is corrupt") from None
    # A truncated file is caught here, by size, rather than as an unpickling error halfway through the load.
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        actual = file.stat().st_size if file.is_file() else None
        if actual is None:
            raise UserError(f"{file}: missing; the checkpoint is incomplete")
        if actual < size:
            raise UserError(f"{file}: truncated ({actual} bytes, the checkpoint's index needs {size})")
    saved = metadata.state_dict_metadata
    for key, value in _flatten(tensors).items():
        if key not in saved:
            raise UserError(
                f"{metadata_file}: no {key!r} in the checkpoint; is it a checkpoint of this model and optimizer?"
            )
        if isinstance(value, torch.Tensor):
            entry = saved[key]
            if not isinstance(entry, TensorStorageMetadata) or tuple(entry.size) != tuple(value.shape):
                found = tuple(entry.size) if isinstance(entry, TensorStorageMetadata) else "not a tensor"
                raise UserError(
                    f"{metadata_file}: {key!r} has shape {found} in the checkpoint but {tuple(value.shape)} here; "
                    "is it a checkpoint of this model?"
                )
    return metadata
