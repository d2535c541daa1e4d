"""Convert a step checkpoint to Hugging Face (and PEFT) files offline, in one process, on any machine."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from toolkit.config import instantiate
from toolkit.config._instantiate import COMPONENT_KEY, TargetNotFound, locate
from toolkit.config.moved import current_path
from toolkit.errors import UserError
from toolkit.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, HFCheckpointer, check_step_checkpoint
from toolkit.checkpoint.step_reader import _first_line, _read_trainer_state, load_dcp
from toolkit.checkpoint.output_dir import check_output_apart
from toolkit.checkpoint.step_files import CHECKPOINTS_DIR, base_files_dir

log = logging.getLogger(__name__)


def check_export(checkpoint: Path, output_dir: Path, *, overwrite: bool) -> DictConfig:
    """Everything an export checks before it writes anything; returns the run's config (``config.yaml``).

    Raises:
        UserError: ``output_dir`` is, holds or lies inside the checkpoint or its run's ``checkpoints/`` folder
            (even with ``overwrite``), or exists without ``overwrite``; the checkpoint is incomplete, a file of it
            is missing, truncated, unreadable or holds more than a checkpoint does; its config names a model or
            checkpointer that is not tunekit's.
    """
    # overwrite replaces the output folder: never the checkpoint itself, nor a folder holding it; and an export
    # inside the run's checkpoints/ would go with the checkpoints keep_last_n prunes, or overwrite=true clears.
    inputs = [("the checkpoint", checkpoint)]
    if checkpoint.resolve().parent.name == CHECKPOINTS_DIR:
        inputs.append(("the run's step checkpoints", checkpoint.parent))
    check_output_apart(output_dir, option="--output", inputs=inputs)
    if output_dir.exists() and not overwrite:
        raise UserError(f"{output_dir} exists; pass --overwrite to replace it")
    check_step_checkpoint(checkpoint)  # the marker, the metadata and every file's size
    config = checkpoint / "config.yaml"
    try:
        cfg = OmegaConf.load(config)
        sections = {}
        for name in _BUILT:  # resolved: an interpolation may name the component
            node = cfg.get(name)
            sections[name] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    except FileNotFoundError:
        raise UserError(f"{config}: missing; {checkpoint} is not a step checkpoint") from None
    except Exception as e:
        raise UserError(f"{config}: unreadable ({_first_line(e)})") from None
    for name, (package, kind, fits) in _BUILT.items():
        for key, dotted in _components(sections[name], name):
            if not _is_ours(dotted, package, fits):
                raise UserError(
                    f"{config}: {key}={dotted!r} is not {kind} of tunekit ({package}); tune export builds only those "
                    "from a checkpoint's config, so that a checkpoint cannot run other code"
                )
    return cfg


# The config sections an export builds, and what their components may be: the checkpoint's config.yaml names the
# callables, and any other (os.system...) would run whatever the file says.
_BUILT: dict[str, tuple[str, str, Callable[[Any], bool]]] = {
    "model": ("toolkit.models", "a model builder", callable),
    "checkpointer": (
        "toolkit.checkpoint", "a checkpointer", lambda found: isinstance(found, type) and issubclass(found, HFCheckpointer)
    ),
}


def _components(node: Any, key: str) -> list[tuple[str, Any]]:
    """``(key path, dotted path)`` of every ``_component_`` in the (resolved) config ``node`` at ``key``."""
    if isinstance(node, dict):
        found = [(f"{key}.{COMPONENT_KEY}", node[COMPONENT_KEY])] if COMPONENT_KEY in node else []
        return found + [pair for k, v in node.items() if k != COMPONENT_KEY for pair in _components(v, f"{key}.{k}")]
    if isinstance(node, list):
        return [pair for i, v in enumerate(node) for pair in _components(v, f"{key}[{i}]")]
    return []


def _is_ours(dotted: Any, package: str, fits: Callable[[Any], bool]) -> bool:
    """Whether ``dotted`` names a callable defined in ``package`` for which ``fits`` holds, importing nothing
    outside the package. One that does not import is left to ``instantiate``'s message."""
    if not isinstance(dotted, str):
        return False
    dotted = current_path(dotted)  # a checkpoint written before its checkpointer moved rooms names its old path
    if not dotted.startswith(package + "."):
        return False
    try:
        target = locate(dotted)
    except TargetNotFound:
        return True
    # Where the callable is defined, not the path it was reached by: toolkit.models.llama3.os.system is os.system.
    module = getattr(target, "__module__", None) or ""
    return (module == package or module.startswith(package + ".")) and fits(target)


def _names(node: Any, value: str) -> bool:
    """Whether the (resolved) config ``node`` holds ``value`` anywhere."""
    if isinstance(node, dict):
        return any(_names(v, value) for v in node.values())
    if isinstance(node, list):
        return any(_names(v, value) for v in node)
    return node == value


def _checkpointer(cfg: DictConfig, checkpoint: Path, *, merged: bool) -> HFCheckpointer:
    """The run's own checkpointer (``cfg.checkpointer``: HFCheckpointer, MetaCheckpointer...), on its base folder
    when that is still there, taking an export's ``config.json`` facts and tokenizer files from the checkpoint's
    copy of them (``base_files``) first: they are the files the run trained with, and the base may have changed.

    A full checkpoint holds every weight, so its base gives only the tokenizer files and the config.json facts an
    export keeps, and the copy stands in for a base that is gone; without either, the export is written from the
    model alone, which a warning says. The base is needed when the model is built from it (``model_family: auto``,
    ``build_from_hf``), where the copy's config.json serves as well, and to merge adapters into it, where nothing
    but its weights will do.

    Raises:
        UserError: the base recorded in the run's config is gone where it is needed; says what to do.
    """
    base = cfg.checkpointer.get("checkpoint_dir")
    copy = base_files_dir(checkpoint)
    if base is not None and not Path(base).expanduser().is_dir():
        if copy is not None and not merged:
            # The copy is a base without weights: the model and the family read its config.json through the config.
            cfg.checkpointer.checkpoint_dir = str(copy)
        else:
            return _without_base(cfg, checkpoint, base, merged=merged)
    checkpointer = instantiate(cfg.checkpointer)
    checkpointer.prefer_source_files(copy)
    return checkpointer


def _without_base(cfg: DictConfig, checkpoint: Path, base: str, *, merged: bool) -> HFCheckpointer:
    """The checkpointer of a run whose base is gone and whose checkpoint holds no copy of its files (or adapters to
    merge into its weights).

    Raises:
        UserError: the base is needed (see :func:`_checkpointer`).
    """
    if cfg.checkpointer.get("model_family") == "auto":
        need = "the model family and architecture are read from its config.json"
    elif _names(OmegaConf.to_container(cfg.model, resolve=True), base):
        need = "the model is built from it"
    elif merged:
        need = "the adapters are merged into its weights"
    else:
        return instantiate(cfg.checkpointer, checkpoint_dir=None)
    raise UserError(
        f"{checkpoint / 'config.yaml'}: the run's base checkpoint {base} (checkpointer.checkpoint_dir) is gone, and "
        f"{need}; restore it there, or pass --base with the folder it moved to"
    )


def export_step_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    merged: bool = False,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    base: str | Path | None = None,
) -> list[Path]:
    """Write the model of ``checkpoint`` (a ``checkpoints/step_<N>`` folder) in Hugging Face layout.

    A full checkpoint becomes a Hugging Face model folder (config, sharded safetensors, tokenizer files of the base
    as the checkpoint keeps them in ``base_files``, or as the base folder has them), streamed a piece at a time,
    whatever the world size that wrote it. An adapter-only
    checkpoint (LoRA, DoRA, QLoRA) becomes ``<output_dir>/adapter`` in PEFT's format and, with ``merged``, the base
    with the adapters merged in, ``<output_dir>/merged``; its base comes from the config's checkpointer (any of
    them: Hugging Face, Meta...), or the seed for a random base, as in the demo. Nothing is written before the
    checkpoint and ``output_dir`` are checked (:func:`check_export`).

    Args:
        base: where the run's base checkpoint (its ``checkpointer.checkpoint_dir``) is now, if it moved.

    Returns:
        the folders written.

    Raises:
        UserError: see :func:`check_export`; a base that is gone where it is needed, or a corrupt tensor.
    """
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    cfg = check_export(checkpoint, output_dir, overwrite=overwrite)
    trainer = _read_trainer_state(checkpoint)
    if base is not None:
        if not Path(base).expanduser().is_dir():
            raise UserError(f"--base: {base} is not a folder")
        cfg.checkpointer.checkpoint_dir = str(base)  # the config's model reads it through the interpolation too
    base = cfg.checkpointer.get("checkpoint_dir")  # the adapters' base, named in adapter_config.json
    checkpointer = _checkpointer(cfg, checkpoint, merged=merged and trainer["model_state"] != "full")
    if trainer["model_state"] == "full" and base is not None and not checkpointer.source_dirs:
        log.warning(
            "%s: the run's base checkpoint %s is gone and this checkpoint keeps no copy of its files: the token ids "
            "(bos/eos/pad) and the tokenizer files are not known, and config.json is written from the model alone; "
            "pass --base with the base's new place to add them", checkpoint, base,
        )
    with torch.device("meta"):
        model = instantiate(cfg.model)
    if trainer["model_state"] == "full":
        return [checkpointer.save_from_dcp(model, checkpoint, output_dir, max_shard_bytes=max_shard_bytes)]
    return _export_adapters(
        checkpoint, output_dir, cfg, model, checkpointer, base=base, merged=merged, max_shard_bytes=max_shard_bytes
    )


def _export_adapters(checkpoint, output_dir, cfg, model, checkpointer, *, base, merged: bool, max_shard_bytes: int):
    from toolkit.modules.peft import (
        adapter_modules, get_adapter_params, get_merged_state_dict, init_adapters, is_adapter_key,
    )
    from toolkit.training.init import init_weights, materialize, set_seed
    from toolkit.checkpoint.peft import save_peft_adapter
    from toolkit.checkpoint.peft_experts import no_peft_form

    # Adapters PEFT cannot load (on experts, trained with dropout) are exported merged only: said before reading.
    problem = no_peft_form(adapter_modules(model))
    if problem and not merged:
        raise UserError(f"{problem}; export the merged model with --merged")
    # What trained, all the step checkpoint holds of the model: the adapters, and the routers trained whole.
    saved = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in get_adapter_params(model).items()}
    load_dcp({f"model.{k}": v for k, v in saved.items()}, checkpoint, no_dist=True)
    if merged:
        # The frozen base, as the recipe built it: loaded, or drawn from the seed in the same order.
        set_seed(cfg.seed)
        with torch.device("meta"):
            model = instantiate(cfg.model)
        materialize(model, device=torch.device("cpu"))
        if base is not None:
            checkpointer.load(model, ignore_missing=is_adapter_key)
        else:
            init_weights(model)
        init_adapters(model)
        model.load_state_dict(saved, strict=False)
    else:
        model.load_state_dict(saved, strict=False, assign=True)  # the base stays on the meta device, unread
    written = [] if problem else [
        save_peft_adapter(
            model, output_dir / "adapter", model_family=checkpointer.family_name,
            base_model_name_or_path=str(base) if base else None,
        )
    ]
    if merged:
        merged_state = get_merged_state_dict(model)
        written.append(checkpointer.save(model, output_dir / "merged", state_dict=merged_state, max_shard_bytes=max_shard_bytes))
    return written
