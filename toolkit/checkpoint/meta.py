"""Meta-format Llama checkpoints in: ``consolidated.00.pth`` ... ``consolidated.NN.pth`` plus ``params.json``.

Meta's reference code (github.com/meta-llama/llama and llama3, ``model.py``) runs tensor-parallel with fairscale and
saves one file per model-parallel rank, each holding that rank's slice of every weight:

- ``ColumnParallelLinear`` (``wq``, ``wk``, ``wv``, ``w1``, ``w3``, ``output``) splits the output features, dim 0;
- ``RowParallelLinear`` (``wo``, ``w2``) splits the input features, dim 1;
- the norms are replicated, and ``rope.freqs`` (Llama 2) is a buffer we recompute;
- ``tok_embeddings`` is Llama 2's ``ParallelEmbedding``, split along the embedding dim (1), but Llama 3's
  ``VocabParallelEmbedding``, split along the vocabulary (0); we tell them apart by which one fits the model.

Each key is concatenated from its slices (one full tensor at a time), converted by the family's ``meta_to_tune``
(names and the rotary q/k row order) and copied into the model's own storage; files are memory-mapped, so the host
never holds a second copy of the model.
"""

import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.modules import GroupedQueryAttention
from toolkit.modules._dtensor import copy_full_
from toolkit.checkpoint.hf import HFCheckpointer
from toolkit.checkpoint.safe_load import RefusedPickle, torch_load
from toolkit.checkpoint.step_reader import _first_line

# Meta module name (the part before ``.weight``) -> the dim fairscale splits it along; absent: replicated.
_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}
_EMBEDDING = "tok_embeddings"
_PARAMS = "params.json"
_CONSOLIDATED = re.compile(r"consolidated\.(\d+)\.pth")


def _consolidated_files(checkpoint_dir: Path) -> list[Path]:
    indices = sorted(int(m.group(1)) for p in checkpoint_dir.iterdir() if (m := _CONSOLIDATED.fullmatch(p.name)))
    if not indices:
        raise UserError(f"{checkpoint_dir}: no consolidated.*.pth files (a Meta checkpoint's 'original' folder)")
    # Every model-parallel rank's file is needed: a gap would silently drop a slice of each weight.
    files = [checkpoint_dir / f"consolidated.{i:02d}.pth" for i in range(indices[-1] + 1)]
    for file in files:
        if not file.is_file():
            raise UserError(
                f"{file}: missing; a model-parallel checkpoint needs every file from consolidated.00.pth to {files[-1].name}"
            )
    return files


def _read(file: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch_load(file, map_location="cpu", mmap=True)
    except RefusedPickle as e:
        raise UserError(str(e)) from None
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise UserError(
            f"{file}: cannot read the checkpoint ({_first_line(e)}); the file may be truncated or corrupt"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{file}: not a state dict of tensors; is it a Meta consolidated checkpoint?")
    return state


def _model_heads(model: nn.Module) -> tuple[int, int] | None:
    heads = {(m.num_heads, m.num_kv_heads) for m in model.modules() if isinstance(m, GroupedQueryAttention)}
    if len(heads) > 1:
        raise UserError(f"the model's attention layers disagree on (num_heads, num_kv_heads): {sorted(heads)}")
    return heads.pop() if heads else None


def _checkpoint_heads(checkpoint_dir: Path, model: nn.Module) -> tuple[int, int]:
    """``(num_heads, num_kv_heads)`` from ``params.json`` (if there is one), checked against the model."""
    model_heads = _model_heads(model)
    params_file = checkpoint_dir / _PARAMS
    if not params_file.is_file():
        if model_heads is None:
            raise UserError(f"{params_file}: missing, and the model has no attention layer to read head counts from")
        return model_heads
    try:
        params = json.loads(params_file.read_text())
        num_heads = int(params["n_heads"])
        num_kv_heads = int(params.get("n_kv_heads") or num_heads)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise UserError(f"{params_file}: not a Meta params.json with n_heads ({type(e).__name__}: {e})") from None
    if model_heads is not None and model_heads != (num_heads, num_kv_heads):
        raise UserError(
            f"{params_file}: n_heads={num_heads}, n_kv_heads={num_kv_heads}, but the model has "
            f"num_heads={model_heads[0]}, num_kv_heads={model_heads[1]}; is it a checkpoint of this model?"
        )
    return num_heads, num_kv_heads


def _split_dim(meta_key: str, shard: torch.Tensor, full_shape: torch.Size, num_files: int) -> int | None:
    """The dim ``meta_key`` is split along across ``num_files`` files, or None when every file holds all of it."""
    module = meta_key.split(".")[-2]  # layers.0.attention.wq.weight -> wq
    if module != _EMBEDDING:
        return _SPLIT_DIM.get(module)
    for dim in (0, 1):  # Llama 3's VocabParallelEmbedding first, then Llama 2's ParallelEmbedding
        if _slice_shape(full_shape, dim, num_files) == shard.shape:
            return dim
    return 0


def _slice_shape(full_shape: torch.Size, dim: int | None, num_files: int) -> torch.Size:
    if dim is None:
        return full_shape
    shape = list(full_shape)
    shape[dim] //= num_files
    return torch.Size(shape)


def _gather(meta_key: str, shards: list[tuple[Path, torch.Tensor]], full_shape: torch.Size) -> torch.Tensor:
    """The whole of ``meta_key`` from its model-parallel slices (one per file), checked against ``full_shape``."""
    num_files = len(shards)
    dim = _split_dim(meta_key, shards[0][1], full_shape, num_files) if num_files > 1 else None
    slice_shape = _slice_shape(full_shape, dim, num_files)
    for file, shard in shards:
        if shard.shape != slice_shape or (dim is not None and full_shape[dim] % num_files):
            whole = f" (its 1/{num_files} of {tuple(full_shape)} along dim {dim})" if dim is not None else ""
            raise UserError(
                f"{file}: {meta_key!r} has shape {tuple(shard.shape)} but the model expects {tuple(slice_shape)}{whole}"
            )
    tensors = [shard for _, shard in shards]
    return tensors[0] if dim is None else torch.cat(tensors, dim=dim)


class MetaCheckpointer(HFCheckpointer):
    """Loads Meta-format Llama checkpoints (``consolidated.*.pth`` + ``params.json``, single or model-parallel).

    Only :meth:`load` differs from :class:`HFCheckpointer`; saving is inherited, so fine-tuned weights are
    exported in Hugging Face format (safetensors, ``config.json`` and the tokenizer files found in
    ``checkpoint_dir``, e.g. ``tokenizer.model``), loadable by ``transformers``, never as Meta ``.pth`` files.

    Args:
        checkpoint_dir: the folder holding ``consolidated.*.pth`` (Meta's downloads: ``<model>/original``).
        model_family: the ``toolkit.models`` package that converts the names, e.g. ``llama3``; it must provide
            ``meta_to_tune`` and ``tune_to_meta`` (``llama2`` and ``llama3`` do).
    """

    @torch.no_grad()
    def load(self, model: nn.Module, *, ignore_missing: Callable[[str], bool] | None = None) -> None:
        """Copy the checkpoint's weights into ``model`` (already materialized), checking every key and shape.

        Model-parallel files are concatenated one weight at a time along the dim Meta split it on.

        Args:
            model: the model to fill.
            ignore_missing: model state-dict keys for which it returns True may be absent from the checkpoint
                (``toolkit.modules.peft.is_adapter_key``: a base checkpoint has no adapters).

        Raises:
            UserError: a family without Meta conversion, no or missing ``consolidated.*.pth`` files, a corrupt or
                truncated file, head counts in ``params.json`` that differ from the model's, an unknown or missing
                key, or a shape mismatch; the message names the file and the key.
        """
        assert self.checkpoint_dir is not None, "load() needs a checkpoint_dir"
        if not (hasattr(self.family, "meta_to_tune") and hasattr(self.family, "tune_to_meta")):
            raise UserError(
                f"model_family: {self.family_name!r} has no Meta checkpoint conversion; use HFCheckpointer "
                "with its Hugging Face checkpoint"
            )
        files = _consolidated_files(self.checkpoint_dir)
        num_heads, num_kv_heads = _checkpoint_heads(self.checkpoint_dir, model)
        heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads)
        targets = model.state_dict()
        # Meta key -> our key, and the full (unsplit) shape the model expects, converted on the meta device.
        expected: dict[str, tuple[str, torch.Size]] = {}
        for key, target in targets.items():
            try:
                (meta_key, meta_value), = self.family.tune_to_meta(
                    {key: torch.empty(target.shape, device="meta")}, **heads
                ).items()
            except KeyError:
                continue  # no Meta counterpart (an adapter): only ignore_missing can excuse it
            expected[meta_key] = (key, meta_value.shape)

        states = [_read(file) for file in files]
        for file, state in zip(files[1:], states[1:]):
            extra = sorted(set(state) - set(states[0]))
            if extra:
                raise UserError(f"{file}: key {extra[0]!r} is not in {files[0].name}; are these files of one checkpoint?")
        loaded: set[str] = set()
        for meta_key in states[0]:
            if meta_key == "rope.freqs":
                continue  # Llama 2's rotary frequencies: a buffer, recomputed by the model
            if meta_key not in expected:
                if meta_key == "output.weight" and "embed_tokens.weight" in targets and "output.weight" not in targets:
                    continue  # a tied model (Llama 3.2 1B/3B): the embedding is the output projection
                raise UserError(f"{files[0]}: key {meta_key!r} has no counterpart in the model; is it a checkpoint of this model?")
            key, full_shape = expected[meta_key]
            shards = []
            for file, state in zip(files, states):
                if meta_key not in state:
                    raise UserError(f"{file}: lacks key {meta_key!r}, which {files[0].name} has; is the file complete?")
                shards.append((file, state[meta_key]))
            full = _gather(meta_key, shards, full_shape)
            (_, value), = self.family.meta_to_tune({meta_key: full}, **heads).items()
            copy_full_(targets[key], value)  # a sharded target keeps only its part
            loaded.add(key)
            del full, value  # one full weight at a time

        tune_to_meta_key = {key: meta_key for meta_key, (key, _) in expected.items()}
        missing = sorted(key for key in set(targets) - loaded if ignore_missing is None or not ignore_missing(key))
        if missing:
            raise UserError(
                f"{self.checkpoint_dir}: checkpoint lacks {len(missing)} weight(s) the model needs, e.g. "
                f"{tune_to_meta_key.get(missing[0], missing[0])!r}; is it a checkpoint of this model?"
            )
