"""Reading a step checkpoint back: everything is checked (marker, config, file sizes, every key and shape) before
anything is restored, and nothing read can run code (:mod:`toolkit.checkpoint.safe_load`)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    set_model_state_dict,
    set_optimizer_state_dict,
)

from toolkit.checkpoint.safe_load import (
    RefusedPickle,
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_dcp_metadata,
    torch_load,
)
from toolkit.checkpoint.step_files import (
    COMPLETE_MARKER,
    TRAINER_STATE,
    TrainingState,
    is_complete,
    local_optimizers,
    state_options,
    tensor_state,
)
from toolkit.config._instantiate import COMPONENT_KEY
from toolkit.config.moved import current_path
from toolkit.errors import UserError

log = logging.getLogger(__name__)

# Config sections a checkpoint's tensors depend on: resuming with any of them changed is refused. A checkpoint of
# the trainable part only also depends on the frozen base it was trained on.
_MUST_MATCH = ("model",)


_MUST_MATCH_TRAINABLE_ONLY = ("model", "checkpointer", "seed")


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if value.keys() == {"tensor", "dtype"}:
            return torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))
        return {key: _from_json(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_from_json(item) for item in value]
    return value


def load_step_checkpoint(
    path: str | Path,
    state: TrainingState,
    *,
    config: DictConfig,
    trainable_only: bool,
    rank: int,
    data_parallel_size: int,
    recipe: str | None = None,
    method: str | None = None,
) -> int:
    """Restore ``state`` from the step checkpoint ``path``; returns its step. A collective: every rank calls it.

    ``trainable_only``: the checkpoint holds only what trains (adapters); ``rank`` picks the RNG file (modulo the
    writing run's world size); ``data_parallel_size`` rescales an fp16 loss scale saved on another layout;
    ``recipe`` and ``method``: what resumes it (see :func:`resume_step`).

    Everything is checked before anything is restored: the marker, the recipe and method that wrote it, the config,
    the files' sizes, and every key and shape against this model and optimizer.

    Raises:
        UserError: an incomplete, truncated or corrupt checkpoint, one of another recipe, method or model, or one
            whose config is incompatible; the message names the file and the key.
    """
    path = Path(path)
    if not is_complete(path):
        raise UserError(f"{path}: not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    trainer = _read_trainer_state(path)
    _check_writer(path, trainer, recipe=recipe, method=method)
    _check_config(path, config, _MUST_MATCH_TRAINABLE_ONLY if trainable_only else _MUST_MATCH)
    if trainer["model_state"] != ("trainable" if trainable_only else "full"):
        raise UserError(
            f"{path / TRAINER_STATE}: holds the {trainer['model_state']} model, but this recipe saves the "
            f"{'trainable' if trainable_only else 'full'} one; resume with the recipe that wrote it"
        )
    tensors = tensor_state(state, trainable_only=trainable_only)
    _check_tensors(path, tensors)
    load_dcp(tensors, path)
    options = state_options(trainable_only=trainable_only, strict=not trainable_only)
    set_model_state_dict(state.model, tensors["model"], options=options)
    set_optimizer_state_dict(
        state.model,
        local_optimizers(state.optimizer),
        tensors["optimizer"],
        options=state_options(trainable_only=trainable_only, flatten_optimizer_state_dict=True),
    )
    state.lr_scheduler.load_state_dict(_from_json(trainer["lr_scheduler"]))
    # The optimizer's own copy of the learning rate (ZeRO-1's outer one is not in its state) is the schedule's.
    for group, lr in zip(state.optimizer.param_groups, state.lr_scheduler.get_last_lr()):
        if isinstance(group["lr"], torch.Tensor):  # torchao's optimizers need it to stay the same tensor
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    try:
        state.sampler.load_state_dict(trainer["sampler"])
    except UserError as e:
        raise UserError(f"{path / TRAINER_STATE}: {e}") from None
    if state.grad_scaler is not None and trainer["grad_scaler"]:
        scaler = dict(trainer["grad_scaler"])
        # The scale is per rank's loss, which carries the data-parallel size (see make_grad_scaler): on another
        # number of processes the same effective scale is this one times old / new.
        saved = trainer.get("data_parallel_size", trainer["world_size"])  # (checkpoints before TP: the same)
        scaler["scale"] = scaler["scale"] * saved / data_parallel_size
        state.grad_scaler.load_state_dict(scaler)
    rng_file = path / "rng" / f"rank_{rank % trainer['world_size']}.pt"
    try:
        _set_rng_state(torch_load(rng_file))
    except RefusedPickle as e:
        raise UserError(str(e)) from None
    except Exception as e:
        raise UserError(f"{rng_file}: cannot read the RNG state ({_first_line(e)})") from None
    return int(trainer["step"])


def resume_step(path: str | Path, *, recipe: str | None, method: str | None) -> int:
    """The step of the step checkpoint ``path``, once it is known to be one that ``recipe`` training by ``method``
    may resume: read from its ``trainer_state.json`` alone, before anything is built from it.

    A checkpoint records the recipe and method that wrote it; one written before they were recorded (by this code
    base, so most likely by the same recipe) resumes as before, its tensors and config still checked on load.

    Raises:
        UserError: the checkpoint is incomplete or unreadable, or another recipe's or method's; the message names
            its ``trainer_state.json``.
    """
    path = Path(path)
    if not is_complete(path):
        raise UserError(f"{path}: not a complete checkpoint (no {COMPLETE_MARKER} marker)")
    trainer = _read_trainer_state(path)
    _check_writer(path, trainer, recipe=recipe, method=method)
    return int(trainer["step"])


def _check_writer(path: Path, trainer: dict[str, Any], *, recipe: str | None, method: str | None) -> None:
    """Refuse a checkpoint another recipe or method wrote: its tensors may even fit (a full fine-tune's and a full
    preference run's do), but continuing one run's schedule, data position and objective in another is not a
    resume. A record or an expectation that is missing (None) is unknown, and allowed."""
    saved_recipe, saved_method = trainer.get("recipe"), trainer.get("method")
    for key, saved, here in (("recipe", saved_recipe, recipe), ("method", saved_method, method)):
        if saved is not None and here is not None and saved != here:
            raise UserError(
                f"{path / TRAINER_STATE}: written by the {saved_recipe} recipe ({saved_method}), but this run is the "
                f"{recipe} recipe ({method}): another {key}'s checkpoint does not resume here; resume it with "
                f"{saved_recipe} ({saved_method}), or start a new run"
            )


def load_dcp(state_dict: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load`` of ``state_dict`` from the checkpoint folder ``path`` (``kwargs``: ``no_dist``...), reading
    nothing that could run code (see :mod:`toolkit.checkpoint.safe_load`), where a failure to read it is one line
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
        # A checkpoint written before a component moved rooms names it by its old path: the same component.
        old = {key: current_path(v) if key.endswith(COMPONENT_KEY) and isinstance(v, str) else v for key, v in old.items()}
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
