"""Hugging Face checkpoints in and out, and the run's output folder.

Loading streams tensor by tensor from memory-mapped safetensors into the model's own storage, so the host never
holds a second copy of the model. Saving writes into a temporary folder renamed into place when complete, so a
crash mid-save never leaves a half-written ``final/``.
"""

import importlib
import json
import os
import pkgutil
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

import toolkit.models
from toolkit.errors import UserError

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "generation_config.json",
)
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def load_model_family(name: str) -> ModuleType:
    """The ``toolkit.models.<name>`` package, which converts that family's checkpoints.

    Raises:
        UserError: no such family (the message lists the families that exist).
    """
    families = sorted(m.name for m in pkgutil.iter_modules(toolkit.models.__path__) if m.ispkg)
    if name not in families:
        raise UserError(f"model_family: unknown family {name!r}; available: {', '.join(families)}")
    return importlib.import_module(f"toolkit.models.{name}")


def _weight_files(checkpoint_dir: Path) -> list[Path]:
    index = checkpoint_dir / _SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: not a valid safetensors index ({e})") from None
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{checkpoint_dir}: no *.safetensors files (and no {_SAFETENSORS_INDEX})")
    for file in files:
        if not file.is_file():
            raise UserError(f"{file}: listed in {_SAFETENSORS_INDEX} but missing")
    return files


class HFCheckpointer:
    """Reads and writes Hugging Face-layout checkpoints (``config.json`` + safetensors) for one model family.

    Args:
        checkpoint_dir: folder of the base weights; ``None`` trains from a random initialization.
        model_family: the ``toolkit.models`` package that converts the names, e.g. ``llama3``.
    """

    def __init__(self, checkpoint_dir: str | None = None, *, model_family: str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir).expanduser() if checkpoint_dir else None
        self.family_name = model_family
        self.family = load_model_family(model_family)
        if self.checkpoint_dir is not None and not self.checkpoint_dir.is_dir():
            raise UserError(f"checkpointer.checkpoint_dir: {self.checkpoint_dir} is not a folder")

    @torch.no_grad()
    def load(self, model: nn.Module, *, ignore_missing: Callable[[str], bool] | None = None) -> None:
        """Copy the checkpoint's weights into ``model`` (already materialized), checking every key and shape.

        Args:
            model: the model to fill.
            ignore_missing: model state-dict keys for which it returns True may be absent from the checkpoint
                (``toolkit.modules.peft.is_adapter_key``: a base checkpoint has no adapters).

        Raises:
            UserError: a corrupt or truncated file, an unknown or missing key, or a shape mismatch; the message
                names the file and the key.
        """
        assert self.checkpoint_dir is not None, "load() needs a checkpoint_dir"
        targets = model.state_dict()
        loaded: set[str] = set()
        for file in _weight_files(self.checkpoint_dir):
            try:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for hf_key in reader.keys():
                        self._load_tensor(file, reader, hf_key, targets, loaded)
            except SafetensorError as e:
                raise UserError(f"{file}: cannot read safetensors ({e}); the file may be truncated or corrupt") from None
        missing = sorted(key for key in set(targets) - loaded if ignore_missing is None or not ignore_missing(key))
        if missing:
            raise UserError(
                f"{self.checkpoint_dir}: checkpoint lacks {len(missing)} weight(s) the model needs, e.g. "
                f"{self.family.tune_key_to_hf(missing[0])!r}; is it a checkpoint of this model?"
            )

    def _load_tensor(self, file: Path, reader, hf_key: str, targets: dict[str, torch.Tensor], loaded: set[str]) -> None:
        if hf_key.endswith("rotary_emb.inv_freq"):
            return
        try:
            key = self.family.hf_key_to_tune(hf_key)
        except KeyError:
            raise UserError(f"{file}: unexpected key {hf_key!r} for this model family") from None
        if key == "output.weight" and key not in targets and "embed_tokens.weight" in targets:
            return  # a tied model: some exporters still write the (shared) lm_head; the embedding is the weight
        if key not in targets:
            raise UserError(f"{file}: key {hf_key!r} has no counterpart in the model; is it a checkpoint of this model?")
        tensor = reader.get_tensor(hf_key)
        target = targets[key]
        if tensor.shape != target.shape:
            raise UserError(
                f"{file}: {hf_key!r} has shape {tuple(tensor.shape)} but the model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
        loaded.add(key)

    def save(
        self,
        model: nn.Module,
        output_dir: str | Path,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        max_shard_bytes: int = 5 * 2**30,
    ) -> Path:
        """Write ``model`` as ``output_dir`` in Hugging Face layout.

        ``state_dict`` gives the full (gathered) weights of a sharded model; by default ``model.state_dict()``.

        Writes ``config.json``, safetensors shards of at most ``max_shard_bytes`` (with an index when there are
        several), and copies the tokenizer files of the source checkpoint. The folder appears only when complete.
        """
        output_dir = Path(output_dir)
        tmp_dir = output_dir.with_name(f".{output_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
        if state_dict is None:
            state_dict = model.state_dict()
        state = {self.family.tune_key_to_hf(k): v.detach().contiguous() for k, v in state_dict.items()}
        shards: list[dict[str, torch.Tensor]] = [{}]
        shard_bytes = 0
        for key, tensor in state.items():
            size = tensor.numel() * tensor.element_size()
            if shards[-1] and shard_bytes + size > max_shard_bytes:
                shards.append({})
                shard_bytes = 0
            shards[-1][key] = tensor
            shard_bytes += size
        if len(shards) == 1:
            save_file(shards[0], str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, start=1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp_dir / name), metadata={"format": "pt"})
                weight_map.update({key: name for key in shard})
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp_dir / _SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
        (tmp_dir / "config.json").write_text(json.dumps(self.family.hf_config(model), indent=2))
        if self.checkpoint_dir is not None:
            for name in _TOKENIZER_FILES:
                if (self.checkpoint_dir / name).is_file():
                    shutil.copy2(self.checkpoint_dir / name, tmp_dir / name)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        tmp_dir.rename(output_dir)
        return output_dir


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded weights of a (possibly FSDP-sharded) model on rank zero's CPU; empty on other ranks.

    A collective under FSDP: every rank must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def prepare_output_dir(output_dir: str | Path, *, overwrite: bool) -> Path:
    """Check that ``output_dir`` holds no finished or started run, or clear our files from it if ``overwrite``.

    Only what a run writes (``metrics.jsonl``, ``final/``, ``checkpoints/``) is removed; other files are kept.

    Raises:
        UserError: the folder already holds a run and ``overwrite`` is False.
    """
    output_dir = Path(output_dir)
    ours = [output_dir / name for name in ("metrics.jsonl", "final", "checkpoints")]
    existing = [p for p in ours if p.exists()]
    if existing and not overwrite:
        raise UserError(
            f"output_dir: {output_dir} already holds a run ({existing[0].name}); "
            "pass overwrite=true to replace it, or choose another output_dir"
        )
    for path in existing:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    output_dir.mkdir(parents=True, exist_ok=True)
    return output_dir
