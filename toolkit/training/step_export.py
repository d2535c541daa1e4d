"""Convert a step checkpoint to Hugging Face (and PEFT) files offline, in one process, on any machine."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf

from toolkit.config import instantiate
from toolkit.errors import UserError
from toolkit.training.checkpointing import DEFAULT_MAX_SHARD_BYTES, HFCheckpointer
from toolkit.training.step_checkpoint import COMPLETE_MARKER, _read_trainer_state, is_complete


def _checkpointer(cfg) -> HFCheckpointer:
    base = cfg.checkpointer.get("checkpoint_dir")
    # The tokenizer files come from the base checkpoint when it is still there; the weights never need it for a
    # full checkpoint.
    base = base if base and Path(base).expanduser().is_dir() else None
    return HFCheckpointer(base, model_family=cfg.checkpointer.model_family)


def export_step_checkpoint(
    checkpoint: str | Path,
    output_dir: str | Path,
    *,
    merged: bool = False,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write the model of ``checkpoint`` (a ``checkpoints/step_<N>`` folder) in Hugging Face layout.

    A full checkpoint becomes a Hugging Face model folder (config, sharded safetensors, tokenizer files of the base
    when it is still on disk), streamed a piece at a time, whatever the world size that wrote it. An adapter-only
    checkpoint (LoRA, DoRA, QLoRA) becomes ``<output_dir>/adapter`` in PEFT's format and, with ``merged``, the base
    with the adapters merged in, ``<output_dir>/merged``; its base comes from the config's checkpoint (or the seed
    for a random base, as in the demo).

    Returns:
        the folders written.

    Raises:
        UserError: not a complete checkpoint, a base that is gone, or ``output_dir`` exists without ``overwrite``.
    """
    checkpoint, output_dir = Path(checkpoint), Path(output_dir)
    if not is_complete(checkpoint):
        raise UserError(f"{checkpoint}: not a complete step checkpoint (no {COMPLETE_MARKER} marker)")
    if output_dir.exists() and not overwrite:
        raise UserError(f"{output_dir} exists; pass --overwrite to replace it")
    trainer = _read_trainer_state(checkpoint)
    cfg = OmegaConf.load(checkpoint / "config.yaml")
    checkpointer = _checkpointer(cfg)
    with torch.device("meta"):
        model = instantiate(cfg.model)
    if trainer["model_state"] == "full":
        return [checkpointer.save_from_dcp(model, checkpoint, output_dir, max_shard_bytes=max_shard_bytes)]
    return _export_adapters(checkpoint, output_dir, cfg, model, checkpointer, merged=merged, max_shard_bytes=max_shard_bytes)


def _export_adapters(checkpoint, output_dir, cfg, model, checkpointer, *, merged: bool, max_shard_bytes: int):
    from toolkit.modules.peft import get_merged_state_dict, init_adapters, is_adapter_key
    from toolkit.training.init import init_weights, materialize, set_seed
    from toolkit.training.peft import save_peft_adapter

    saved = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items() if is_adapter_key(k)}
    dcp.load({f"model.{k}": v for k, v in saved.items()}, checkpoint_id=str(checkpoint), no_dist=True)
    base = cfg.checkpointer.get("checkpoint_dir")
    if merged:
        # The frozen base, as the recipe built it: loaded, or drawn from the seed in the same order.
        set_seed(cfg.seed)
        with torch.device("meta"):
            model = instantiate(cfg.model)
        materialize(model, device=torch.device("cpu"))
        if base is not None:
            if checkpointer.checkpoint_dir is None:
                raise UserError(f"checkpointer.checkpoint_dir: the base {base} is gone; it is needed to merge")
            checkpointer.load(model, ignore_missing=is_adapter_key)
        else:
            init_weights(model)
        init_adapters(model)
        model.load_state_dict(saved, strict=False)
    else:
        model.load_state_dict(saved, strict=False, assign=True)  # the base stays on the meta device, unread
    written = [
        save_peft_adapter(
            model, output_dir / "adapter", model_family=checkpointer.family_name,
            base_model_name_or_path=str(base) if base else None,
        )
    ]
    if merged:
        merged_state = get_merged_state_dict(model)
        written.append(checkpointer.save(model, output_dir / "merged", state_dict=merged_state, max_shard_bytes=max_shard_bytes))
    return written
