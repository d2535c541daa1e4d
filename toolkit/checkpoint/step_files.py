"""A run's step checkpoints as folders: their layout, which are complete, and which one a run resumes from.

This module is what the writer (:mod:`~toolkit.checkpoint.step_writer`), the reader
(:mod:`~toolkit.checkpoint.step_reader`), ``tune export`` and the output folder's checks agree on.

``<output_dir>/checkpoints/step_<N>/`` holds:

=========================  ============================================================================
``.metadata``, ``*.distcp``  ``torch.distributed.checkpoint`` (DCP): the model (or only its trainable part) and
                           the optimizer state, each rank writing its own shard; keys are parameter names, so
                           any world size and any data-parallel strategy can load them (DCP reshards).
``trainer_state.json``     step, data position, LR schedule, loss scale, and what wrote it (the layout, the
                           recipe and its method: only the same recipe and method resume it).
``rng/rank_<r>.pt``        each rank's RNG states (Python, NumPy, torch CPU, CUDA).
``config.yaml``            the config of the run that wrote it.
``base_files/``            the base checkpoint's ``config.json`` and tokenizer files, so the checkpoint exports
                           alone (token ids, context length, tokenizer) once the base folder is gone.
``COMPLETE``               written last, atomically: a folder without it is ignored by resume and pruned.
=========================  ============================================================================
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.optim import Optimizer

from toolkit.data import GlobalBatchSampler
from toolkit.errors import UserError
from toolkit.optim.optimizers import OptimizerInBackward
from toolkit.parallel import is_zero_redundancy

log = logging.getLogger(__name__)
# One process without a process group loads and saves alone, as intended: DCP's warning says only that.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

CHECKPOINTS_DIR = "checkpoints"


COMPLETE_MARKER = "COMPLETE"


TRAINER_STATE = "trainer_state.json"


BASE_FILES_DIR = "base_files"


_STEP_DIR = re.compile(r"^step_(\d+)$")


# Copied from the source checkpoint into an export when there: the tokenizer (fast or slow, and the chat template,
# which transformers keeps in its own file) and the generation settings.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", "generation_config.json",
)


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



def named_step_checkpoint(path: Path) -> Path:
    """The step checkpoint a command's argument names (``tune export CHECKPOINT``): the folder itself, or the newest
    complete checkpoint of a run when it names the run's ``output_dir``.

    Raises:
        UserError: the folder does not exist (the message lists its run's complete checkpoints), or a run folder
            holds no complete checkpoint.
    """
    if not path.exists():
        # keep_last_n deletes older checkpoints: say which ones there are, rather than only that this one is gone.
        run = path.parent.parent if path.parent.name == CHECKPOINTS_DIR else path.parent
        found = ", ".join(p.name for p in list_checkpoints(run))
        there = f"; the complete step checkpoints of {run} are {found}" if found else ""
        raise UserError(f"{path}: no such folder{there}")
    if (path / CHECKPOINTS_DIR).is_dir():  # a run's output_dir
        newest = latest_checkpoint(path)
        if newest is None:
            raise UserError(f"{path}: the run has no complete step checkpoint in {path / CHECKPOINTS_DIR}")
        return newest
    return path

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


def base_files_dir(checkpoint: str | Path) -> Path | None:
    """The ``base_files`` folder of the step checkpoint ``checkpoint`` (the base's ``config.json`` and tokenizer
    files, as the run had them), or None: not a step checkpoint, or one written before they were kept."""
    folder = Path(checkpoint) / BASE_FILES_DIR
    return folder if folder.is_dir() and (Path(checkpoint) / ".metadata").is_file() else None


def os_error_text(error: OSError) -> str:
    """An OS error as its code and text, e.g. ``ENOSPC: No space left on device``, for a one-line message."""
    code = errno.errorcode.get(error.errno) if error.errno else None
    text = error.strerror or str(error) or type(error).__name__
    return f"{code}: {text}" if code else text


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


def local_optimizers(optimizer: Optimizer) -> Optimizer | tuple[Optimizer, ...]:
    """The optimizers whose state a checkpoint holds for ``optimizer``.

    ZeRO-1 keeps the state of this rank's parameters in an inner optimizer, the step inside backward one optimizer
    per parameter; saved by parameter name, their state is that of one optimizer over all parameters, and reshards
    to any world size like the rest.
    """
    if is_zero_redundancy(optimizer):
        return optimizer.optim
    if isinstance(optimizer, OptimizerInBackward):
        return tuple(optimizer.optimizers.values())
    return optimizer


def state_options(*, trainable_only: bool, **kwargs: Any) -> StateDictOptions:
    """DCP's state-dict options for a checkpoint of the whole model or (``trainable_only``) of what trains."""
    return StateDictOptions(ignore_frozen_params=trainable_only, **kwargs)


def tensor_state(state: TrainingState, *, trainable_only: bool) -> dict[str, Any]:
    """The model's and the optimizer's tensors, by parameter name, as a step checkpoint holds them."""
    return {
        "model": get_model_state_dict(state.model, options=state_options(trainable_only=trainable_only)),
        "optimizer": get_optimizer_state_dict(
            state.model,
            local_optimizers(state.optimizer),
            options=state_options(trainable_only=trainable_only, flatten_optimizer_state_dict=True),
        ),
    }
