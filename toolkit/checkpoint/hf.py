"""Hugging Face checkpoints in and out.

Loading streams tensor by tensor from memory-mapped safetensors into the model's own storage, so the host never
holds a second copy of the model. Saving streams tensor by tensor too, and in a distributed run every rank writes
its share of the files, a sharded model never gathered on one rank. Both write into a temporary folder renamed into
place when complete, so a crash mid-save never leaves a half-written ``final/``.

Where a family stacks tensors that Hugging Face stores one by one (the experts of a mixture-of-experts layer, see
``toolkit.models._expert_keys``), each HF tensor read fills its slice of ours, and exports write the slices again.
The files' layout and the streaming writer: :mod:`toolkit.checkpoint.safetensors_files`.
"""

import importlib
import json
import logging
import pkgutil
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

import toolkit.models
from toolkit.errors import ArgumentError, UserError, read_json
from toolkit.models._expert_keys import Part
from toolkit.modules._dtensor import full_tensor, local_region
from toolkit.modules.moe import MoEFeedForward
from toolkit.modules.peft.nf4_experts import NF4Stack, nf4_stacks
from toolkit.parallel.distributed import shared_filesystem
from toolkit.training.watchdog import progress
from toolkit.parallel import unwrap
from toolkit.checkpoint.safetensors_files import (
    SAFETENSORS_INDEX,
    Joined,
    Source,
    TensorReader,
    TensorSpec,
    dcp_tensor_reader,
    files_dtype,
    memory_reader,
    part_specs,
    plan_files,
    write_index,
    write_safetensors,
)
from toolkit.checkpoint.step_files import (
    COMPLETE_MARKER,
    TOKENIZER_FILES,
    base_files_dir,
    is_complete,
    os_error_text,
    raise_on_every_rank,
)
from toolkit.checkpoint.step_reader import _check_tensors, load_dcp
from toolkit.checkpoint.step_writer import write_failure

# Keys of the source's config.json an export drops before laying the model's own over it: the rotary settings in
# both spellings (transformers 5 reads its ``rope_parameters`` over the ``rope_theta``/``rope_scaling`` we write),
# the dtype in both spellings (``dtype`` wins over our ``torch_dtype``), custom code and quantization (the export
# is the family's standard architecture, dense).
_NOT_FROM_SOURCE = (
    "rope_scaling", "rope_theta", "rope_parameters", "dtype", "torch_dtype", "auto_map", "quantization_config",
)
log = logging.getLogger(__name__)

_SHARDS_DIR = ".shards"  # an export's intermediate per-rank shards, removed when it completes
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30


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
    index = checkpoint_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index}: not a valid safetensors index ({e})") from None
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for ext in ("bin", "pt", "pth") for p in checkpoint_dir.glob(f"*.{ext}"))
        hint = ""
        if any(name.startswith("consolidated.") for name in pickled):
            hint = "; for Meta's consolidated.*.pth set checkpointer._component_=toolkit.checkpoint.MetaCheckpointer"
        elif pickled:  # weights in a pickle are never read: unpickling a file can run any code it names
            hint = (
                f"; {pickled[0]} is a pickle, which is not loaded since it could run code: convert it to safetensors "
                "(transformers' save_pretrained writes them)"
            )
        raise UserError(f"{checkpoint_dir}: no *.safetensors files (and no {SAFETENSORS_INDEX}){hint}")
    for file in files:
        if not file.is_file():
            raise UserError(f"{file}: listed in {SAFETENSORS_INDEX} but missing")
    return files


class HFCheckpointer:
    """Reads and writes Hugging Face-layout checkpoints (``config.json`` + safetensors) for one model family.

    Args:
        checkpoint_dir: folder of the base weights; ``None`` trains from a random initialization.
        model_family: the ``toolkit.models`` package that converts the names, e.g. ``llama3``; ``auto`` reads it
            from the checkpoint's ``config.json``.
    """

    def __init__(self, checkpoint_dir: str | None = None, *, model_family: str) -> None:
        self.checkpoint_dir = Path(checkpoint_dir).expanduser() if checkpoint_dir else None
        if self.checkpoint_dir is not None and not self.checkpoint_dir.is_dir():
            raise ArgumentError("checkpoint_dir", f"{self.checkpoint_dir} is not a folder")
        if model_family == "auto":
            if self.checkpoint_dir is None:
                raise ArgumentError("model_family", "auto reads the checkpoint's config.json; set checkpoint_dir")
            model_family = toolkit.models.read_hf_config(self.checkpoint_dir)[1]
        self.family_name = model_family
        self.family = load_model_family(model_family)
        # A family with stacked tensors (experts) also maps HF tensors to their parts (toolkit.models._expert_keys).
        self._hf_key_to_parts = getattr(self.family, "hf_key_to_parts", None)
        self._tune_key_to_hf_slices = getattr(self.family, "tune_key_to_hf_slices", None)
        # A family built from part of a larger checkpoint names the tensors it leaves (Gemma 3's vision tower).
        self._skipped_hf_key = getattr(self.family, "skipped_hf_key", None)
        # Where an export takes the source's config.json (token ids, context length... where the model agrees) and
        # tokenizer files from, the first folder holding each: a step checkpoint's copy of its base's, or the folder.
        self.source_dirs: tuple[Path, ...] = ()
        self.source_config: dict | None = None
        if self.checkpoint_dir is not None:
            self.prefer_source_files(self.checkpoint_dir)
            self.prefer_source_files(base_files_dir(self.checkpoint_dir))

    def prefer_source_files(self, folder: Path | None) -> None:
        """Take an export's ``config.json`` and tokenizer files from ``folder`` first (a step checkpoint's
        ``base_files``: the base's files as the run had them), and from the earlier folders for those it lacks."""
        if folder is None:
            return
        self.source_dirs = (Path(folder), *self.source_dirs)
        source_config = self._source_file("config.json")
        self.source_config = read_json(source_config) if source_config is not None else None

    def _source_file(self, name: str) -> Path | None:
        return next((folder / name for folder in self.source_dirs if (folder / name).is_file()), None)

    @torch.no_grad()
    def load(self, model: nn.Module, *, ignore_missing: Callable[[str], bool] | None = None) -> None:
        """Copy the checkpoint's weights into ``model`` (already materialized), checking every key and shape.

        ``checkpoint_dir`` may also be one of our step checkpoints (``checkpoints/step_<N>``, saved on any number of
        processes): a new run then starts from its weights (only its model; its optimizer and position are for
        ``resume_from``).

        Args:
            model: the model to fill.
            ignore_missing: model state-dict keys for which it returns True may be absent from the checkpoint
                (``toolkit.modules.peft.is_adapter_key``: a base checkpoint has no adapters).

        Raises:
            UserError: a corrupt or truncated file, an unknown or missing key (or expert), a shape mismatch, or
                another number of experts than the model's; the message names the file and the key.
        """
        assert self.checkpoint_dir is not None, "load() needs a checkpoint_dir"
        self._check_routing(model)
        targets = _load_targets(model)
        loaded: set[str] = set()
        slices: dict[str, set[int]] = {}  # of a stacked tensor: the indices along dim 0 read so far
        skipped: Counter[str] = Counter()  # tensors the model does not use, by what the family says they are
        if (self.checkpoint_dir / ".metadata").is_file():
            self._load_step_checkpoint(targets, loaded)
        files = _weight_files(self.checkpoint_dir) if not loaded else []
        if self._hf_key_to_parts is not None:
            self._check_slice_counts(files, targets)
        for file in files:
            progress(f"loading {file.name}")
            try:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for hf_key in reader.keys():
                        if self._skipped_hf_key is not None and (part := self._skipped_hf_key(hf_key)) is not None:
                            skipped[part] += 1
                            continue
                        self._load_tensor(file, reader, hf_key, targets, loaded, slices)
            except SafetensorError as e:
                raise UserError(_unreadable(file, e)) from None
        if skipped and (not dist.is_initialized() or dist.get_rank() == 0):
            parts = ", ".join(f"{count} of {part}" for part, count in sorted(skipped.items()))
            log.warning("%s: skipped %d tensors the %s model does not use (%s)", self.checkpoint_dir,
                        sum(skipped.values()), self.family_name, parts)
        loaded.update(key for key, indices in slices.items() if len(indices) == targets[key].shape[0])
        missing = sorted(key for key in set(targets) - loaded if ignore_missing is None or not ignore_missing(key))
        if missing:
            key = missing[0]
            hf_key = next(
                (hf for hf, source in self._hf_sources({key: TensorSpec.of(targets[key])}).items()
                 if source.index not in slices.get(key, ())),
            )
            raise UserError(
                f"{self.checkpoint_dir}: checkpoint lacks {len(missing)} weight(s) the model needs, e.g. "
                f"{hf_key!r}; is it a checkpoint of this model?"
            )

    def _load_step_checkpoint(self, targets: dict[str, torch.Tensor], loaded: set[str]) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata_file = self.checkpoint_dir / ".metadata"
        saved = check_step_checkpoint(self.checkpoint_dir).state_dict_metadata
        wanted = {}
        for name, entry in saved.items():
            if not name.startswith("model.") or not isinstance(entry, TensorStorageMetadata):
                continue
            key = name[len("model."):]
            if key not in targets:
                raise UserError(f"{metadata_file}: key {name!r} has no counterpart in the model; is it a checkpoint of this model?")
            if tuple(entry.size) != tuple(targets[key].shape):
                raise UserError(
                    f"{metadata_file}: {name!r} has shape {tuple(entry.size)} but the model expects "
                    f"{tuple(targets[key].shape)}"
                )
            wanted[name] = targets[key]
        # NF4 experts (QLoRA) are read whole, one stack at a time, and quantized expert by expert.
        for name, stack in [(name, wanted.pop(name)) for name, t in list(wanted.items()) if isinstance(t, NF4Stack)]:
            full = torch.empty(stack.shape, dtype=saved[name].properties.dtype, device=stack.codes.device)
            load_dcp({name: full}, self.checkpoint_dir, no_dist=True)
            stack.quantize_all_(full)
            loaded.add(name[len("model."):])
        # Sharded targets load collectively, each rank reading its part; whole ones alone.
        sharded = any(isinstance(t, DTensor) for t in wanted.values())
        load_dcp(wanted, self.checkpoint_dir, no_dist=not sharded)
        loaded.update(name[len("model."):] for name in wanted)

    def _check_routing(self, model: nn.Module) -> None:
        """Refuse a checkpoint whose ``config.json`` routes each token to another number of experts than the model's
        routers do (the weights cannot tell: a router scores every expert whatever its top-k)."""
        config = self.source_config or {}
        top_k = config.get("num_experts_per_tok")
        blocks = [m for m in unwrap(model).modules() if isinstance(m, MoEFeedForward)]
        if top_k is not None and blocks and blocks[0].top_k != top_k:
            raise UserError(
                f"{self.checkpoint_dir}: the checkpoint's config.json routes each token to num_experts_per_tok={top_k} "
                f"experts but the model to {blocks[0].top_k}; is it a checkpoint of this model?"
            )

    def _parts(self, hf_key: str) -> list[Part]:
        """Where an HF tensor goes: parts of our stacked tensors, or one whole tensor (``KeyError``: neither)."""
        parts = self._hf_key_to_parts(hf_key) if self._hf_key_to_parts is not None else None
        return parts if parts is not None else [Part(self.family.hf_key_to_tune(hf_key))]

    def _hf_sources(self, specs: dict[str, "TensorSpec"], *, prefix: str = "") -> dict[str, "Source | Joined"]:
        """The HF tensors that our tensors (``specs``, by our key) are written as, in order, each with where its
        values are (our key after ``prefix``): a tensor whole, one slice along dim 0 of a stacked one, or several
        whole ones joined along their rows (a fused projection)."""
        sources = {}
        for key, spec in specs.items():
            slices = None
            if self._tune_key_to_hf_slices is not None and spec.shape:
                slices = self._tune_key_to_hf_slices(key, spec.shape[0])
            if slices is None:
                hf_key = self.family.tune_key_to_hf(key)
                joined = sources.get(hf_key)
                part = Source(prefix + key, spec)
                sources[hf_key] = part if joined is None else Joined((*joined.parts, part))
            else:
                sources.update({hf_key: Source(prefix + key, spec, index) for index, hf_key in enumerate(slices)})
        for hf_key, source in sources.items():
            if isinstance(source, Joined):
                sources[hf_key] = self._order_joined(hf_key, source, prefix)
        return sources

    def _order_joined(self, hf_key: str, joined: "Joined", prefix: str) -> "Joined":
        """Several of our tensors written as one HF tensor (a fused projection: Phi-3's ``qkv_proj``): their rows
        in the order of the family's ``hf_key_to_parts``; all of them, or none (the family would not load it)."""
        order = [prefix + part.key for part in (self._hf_key_to_parts(hf_key) if self._hf_key_to_parts else None) or ()]
        by_name = {part.name: part for part in joined.parts}
        if sorted(order) != sorted(by_name):
            raise ValueError(f"{hf_key}: the tensors {sorted(by_name)} do not make up its parts {order}")
        return Joined(tuple(by_name[name] for name in order))

    def _check_slice_counts(self, files: list[Path], targets: dict[str, torch.Tensor]) -> None:
        """Before any tensor is read, from the files' headers: the slices (experts) of each stacked tensor the
        checkpoint holds against the model's, so that a checkpoint with another number of experts is refused in one
        line naming both numbers, not at the first tensor that does not fit.

        More slices than the model's in any tensor, or the same other number in all of them, is another expert
        count; fewer in some only are missing tensors, which :meth:`load` names at the end.
        """
        counts: dict[str, tuple[int, str]] = {}  # our stacked key -> (slices held, the HF key showing the most)
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as reader:
                    for hf_key in reader.keys():
                        for part in self._hf_key_to_parts(hf_key) or ():
                            shape = reader.get_slice(hf_key).get_shape()
                            if part.index is None and len(shape) < 3:
                                continue  # a fused projection of whole matrices (Phi-3's qkv_proj): nothing stacked
                            held = part.index + 1 if part.index is not None else shape[0]
                            if part.key in targets and held > counts.get(part.key, (0, ""))[0]:
                                counts[part.key] = (held, hf_key)
            except SafetensorError as e:
                raise UserError(_unreadable(file, e)) from None
        wrong = {key: (held, hf_key) for key, (held, hf_key) in counts.items() if held != targets[key].shape[0]}
        more = [key for key, (held, _) in wrong.items() if held > targets[key].shape[0]]
        same_in_all = wrong.keys() == counts.keys() and len({held for held, _ in wrong.values()}) == 1
        if more or (wrong and same_in_all):
            key = more[0] if more else min(wrong)
            held, hf_key = wrong[key]
            raise UserError(
                f"{self.checkpoint_dir}: the checkpoint has {held} experts per layer but the model has "
                f"{targets[key].shape[0]} (counted from {hf_key!r}); is it a checkpoint of this model?"
            )

    def _load_tensor(
        self, file: Path, reader, hf_key: str, targets: dict[str, torch.Tensor], loaded: set[str],
        slices: dict[str, set[int]],
    ) -> None:
        if hf_key.endswith("rotary_emb.inv_freq"):
            return
        try:
            parts = self._parts(hf_key)
        except KeyError:
            raise UserError(f"{file}: unexpected key {hf_key!r} for this model family") from None
        source = reader.get_slice(hf_key)
        shape = tuple(source.get_shape())
        for part in parts:
            key = part.key
            if key == "output.weight" and key not in targets and "embed_tokens.weight" in targets:
                return  # a tied model: some exporters still write the (shared) lm_head; the embedding is the weight
            if key not in targets:
                raise UserError(
                    f"{file}: key {hf_key!r} has no counterpart in the model; is it a checkpoint of this model?"
                )
            target = targets[key]
            expected, offset = _part_shape(tuple(target.shape), part, parts, targets)
            if shape != expected:
                raise UserError(f"{file}: {hf_key!r} has shape {shape} but the model expects {expected}")
            if shape:
                _copy_part(target, part, source, offset)
            else:
                target.copy_(reader.get_tensor(hf_key))
            if part.index is None:
                loaded.add(key)
            else:
                slices.setdefault(key, set()).add(part.index)

    def save(
        self,
        model: nn.Module,
        output_dir: str | Path,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Write ``model`` as ``output_dir`` in Hugging Face layout, from this process alone.

        ``state_dict`` gives full (unsharded) weights to write instead of ``model.state_dict()``. In a
        distributed run, :meth:`export` writes from every rank at once without gathering the model.

        Writes ``config.json``, safetensors shards of at most ``max_shard_bytes`` (with an index when there are
        several), and copies the tokenizer files of the source checkpoint. The folder appears only when complete.
        """
        if state_dict is None:
            state_dict = model.state_dict()
        sources = self._hf_sources({key: TensorSpec.of(tensor) for key, tensor in state_dict.items()})
        read = memory_reader(state_dict, sources)
        return self._write_folder(output_dir, model, part_specs(sources), lambda tmp_dir: read, max_shard_bytes)

    def export(
        self,
        model: nn.Module,
        output_dir: str | Path,
        *,
        state_dict: dict[str, torch.Tensor] | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Write ``model`` (plain, DDP, FSDP-sharded or tensor-parallel) as ``output_dir`` in Hugging Face layout,
        from every rank.

        A collective: every rank calls it. The output files are shared out among the ranks, each writing its own
        in parallel, one tensor at a time. A sharded model is never gathered: every rank first writes its shards
        (``torch.distributed.checkpoint``, in parallel), then each file's owner reads back just the tensors of its
        files. Host memory stays at about one tensor per rank above the training state.

        ``state_dict`` gives the weights to write instead of the model's (our names; each rank's own shards where
        they are DTensors, as ``model.state_dict()`` holds them: a LoRA model's merged weights).

        This needs ``output_dir`` on a filesystem every node sees. On nodes with local disks only, rank zero
        gathers the model into host memory and writes it alone (the other nodes' folders stay empty).
        """
        shared = shared_filesystem(Path(output_dir).parent)
        # Nodes with local disks (the folder is not shared): rank zero gathers the model and writes every file.
        if state_dict is None:
            options = StateDictOptions(full_state_dict=not shared, cpu_offload=not shared)
            full = get_model_state_dict(model, options=options)
        elif shared:
            full = state_dict
        else:  # gathered one tensor at a time (a collective for a DTensor), kept on rank zero's CPU
            rank_zero = not dist.is_initialized() or dist.get_rank() == 0
            full = {}
            for key, tensor in state_dict.items():
                whole = full_tensor(tensor) if isinstance(tensor, DTensor) else tensor
                if rank_zero:
                    full[key] = whole.cpu()
        sources = self._hf_sources({key: TensorSpec.of(tensor) for key, tensor in full.items()})
        sharded = any(isinstance(tensor, DTensor) for tensor in full.values())

        def source(tmp_dir: Path) -> TensorReader:
            if not sharded:
                return memory_reader(full, sources)  # every rank holds every tensor
            dcp.save(full, checkpoint_id=str(tmp_dir / _SHARDS_DIR))
            return dcp_tensor_reader(tmp_dir / _SHARDS_DIR, sources)

        return self._write_folder(
            output_dir, model, part_specs(sources), source, max_shard_bytes, collective=True, all_ranks=shared
        )

    def save_from_dcp(
        self,
        model: nn.Module,
        checkpoint_dir: str | Path,
        output_dir: str | Path,
        *,
        prefix: str = "model.",
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> Path:
        """Convert the model in a ``torch.distributed.checkpoint`` folder (a step checkpoint; keys ``prefix`` + our
        names) to Hugging Face layout, in this process alone, reading it in pieces of about 256 MiB whatever
        sharding it was saved with. ``model`` (on the meta device is enough) gives ``config.json``; dtypes are the
        checkpoint's.
        """
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        saved = check_step_checkpoint(Path(checkpoint_dir)).state_dict_metadata
        specs = {}
        for key, tensor in model.state_dict().items():
            entry = saved.get(prefix + key)
            if not isinstance(entry, TensorStorageMetadata):
                raise UserError(f"{checkpoint_dir}: no tensor {prefix + key!r}; is it a checkpoint of this model?")
            if tuple(entry.size) != tuple(tensor.shape):  # config.json describes the model: it must fit the tensors
                raise UserError(
                    f"{checkpoint_dir}: {prefix + key!r} has shape {tuple(entry.size)} but the model expects "
                    f"{tuple(tensor.shape)}; is it a checkpoint of this model?"
                )
            specs[key] = TensorSpec(tuple(entry.size), entry.properties.dtype)
        sources = self._hf_sources(specs, prefix=prefix)
        read = dcp_tensor_reader(Path(checkpoint_dir), sources)
        return self._write_folder(output_dir, model, part_specs(sources), lambda tmp_dir: read, max_shard_bytes)

    def _write_folder(
        self,
        output_dir: str | Path,
        model: nn.Module,
        specs: dict[str, "TensorSpec"],
        source: Callable[[Path], "TensorReader"],
        max_shard_bytes: int,
        *,
        collective: bool = False,
        all_ranks: bool = True,
    ) -> Path:
        """Write the files into a temporary folder next to ``output_dir`` and rename it to ``output_dir`` once complete
        (with the config and tokenizer files; ``specs`` give the weights' dtype for the config). An earlier
        ``output_dir`` is replaced only then, so a failed write leaves it as it was.

        Raises:
            UserError: the OS refused a write (a full disk, a read-only folder...), on every rank of a collective
                write; the temporary folder is removed.
        """
        output_dir = Path(output_dir)
        tmp_dir = output_dir.with_name(f".{output_dir.name}.partial")
        files = plan_files(specs, max_shard_bytes)
        together = collective and dist.is_initialized()
        rank = dist.get_rank() if together else 0
        world_size = dist.get_world_size() if together and all_ranks else 1

        def step(write: Callable[[], Any]) -> None:
            # Run ``write``; then every rank (of a collective write) raises the first OS error any of them met.
            error = None
            try:
                write()
            except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
                os_error = write_failure(e, tmp_dir)
                if os_error is None:
                    if not together:  # alone, nothing else writes there: leave no half-written folder behind
                        shutil.rmtree(tmp_dir, ignore_errors=True)
                    raise
                kept = "the earlier one is kept" if output_dir.exists() else "nothing was written there"
                error = f"{output_dir}: cannot write the Hugging Face checkpoint ({os_error_text(os_error)}); {kept}"
            try:
                if together:
                    raise_on_every_rank(error)
                elif error is not None:
                    raise UserError(error)
            except UserError:
                if rank == 0:
                    shutil.rmtree(tmp_dir, ignore_errors=True)
                raise

        def start() -> None:
            if rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)  # left by an export that was interrupted
                tmp_dir.mkdir(parents=True)

        def write_files() -> None:
            read = source(tmp_dir)
            for i, (name, keys) in enumerate(files.items()):
                if i % world_size == rank:
                    write_safetensors(tmp_dir / name, keys, specs, read(keys))
            if rank == 0:
                write_index(tmp_dir, files, specs)

        def finish() -> None:
            if rank == 0:
                self._complete_folder(tmp_dir, output_dir, model, files_dtype(specs))

        for write in (start, write_files, finish):
            step(write)
        return output_dir

    def _complete_folder(self, tmp_dir: Path, output_dir: Path, model: nn.Module, dtype: torch.dtype | None) -> None:
        """Add the config and tokenizer files to the written ``tmp_dir`` and put it in place of ``output_dir``."""
        shutil.rmtree(tmp_dir / _SHARDS_DIR, ignore_errors=True)
        config = export_config(self.source_config, self.family.hf_config(unwrap(model)))
        if dtype is not None:
            config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (tmp_dir / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES:
            if (source := self._source_file(name)) is not None:
                shutil.copy2(source, tmp_dir / name)
        # The earlier folder is moved aside, not deleted, until the new one is in its place.
        old = output_dir.with_name(f".{output_dir.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if output_dir.exists():
            output_dir.rename(old)
        try:
            tmp_dir.rename(output_dir)
        except OSError:
            if old.exists():
                old.rename(output_dir)
            raise
        shutil.rmtree(old, ignore_errors=True)


def _unreadable(file: Path, error: SafetensorError) -> str:
    return f"{file}: cannot read safetensors ({error}); the file may be truncated or corrupt"


def export_config(source: dict | None, ours: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` of an export: the family's ``hf_config`` of the model (``ours``) laid over the source
    checkpoint's, so that what the model cannot tell (token ids, generation and tokenizer settings...) is kept.

    Every key ``ours`` writes is ours (the architecture is the model's); :data:`_NOT_FROM_SOURCE` keys come from
    ours alone. ``max_position_embeddings`` is the larger of the two: a model built for a shorter training length
    (``max_seq_len``) still serves the source's context. A source of another ``model_type`` is not used.
    """
    if not isinstance(source, dict) or source.get("model_type") != ours.get("model_type"):
        return ours
    config = {key: value for key, value in source.items() if key not in _NOT_FROM_SOURCE}
    config.update(ours)
    if isinstance(source.get("max_position_embeddings"), int):
        config["max_position_embeddings"] = max(source["max_position_embeddings"], ours["max_position_embeddings"])
    return config


def _part_shape(
    shape: tuple[int, ...], part: Part, parts: list[Part], targets: dict[str, torch.Tensor]
) -> tuple[tuple[int, ...], int]:
    """The shape of the HF tensor that fills ``part`` of our tensor of ``shape``, and the first of its rows
    (second-to-last dimension) that ``part`` takes: a fused tensor's row blocks are our ``parts``' rows, in order."""
    if part.index is not None:
        shape = shape[1:]
    if part.rows is None:
        return shape, 0
    blocks = sorted((p for p in parts if p.rows is not None), key=lambda p: p.rows[0])
    rows = [targets[p.key].shape[-2] if p.key in targets else shape[-2] for p in blocks]
    offset = sum(rows[: part.rows[0]])
    return (*shape[:-2], sum(rows), shape[-1]), offset


def _load_targets(model: nn.Module) -> dict[str, "torch.Tensor | NF4Stack"]:
    """What a load fills, by state-dict key: the model's state dict, with each NF4 stack of experts (QLoRA) in place of
    its parts, under the key of the stacked weight it stores (``layers.0.mlp.experts.gate_proj``)."""
    targets = model.state_dict()
    for name, stack in nf4_stacks(model).items():
        for part, _ in stack.named_parameters():
            del targets[f"{name}.{part}"]
        targets[name] = stack
    return targets


def _copy_part(target: "torch.Tensor | NF4Stack", part: Part, source: Any, offset: int) -> None:
    """Copy the HF tensor ``source`` (a safetensors slice) into its ``part`` of ``target``, whose rows start at
    ``offset`` in it; into a sharded target, only what lies in this rank's shard is read (nothing for an expert of
    another rank). An NF4 stack quantizes what it is given, one expert at a time."""
    if isinstance(target, NF4Stack):
        experts, rows, _ = target.shape
        rows = slice(offset, offset + rows)
        if part.index is not None:
            target.quantize_(part.index, source[rows, :])
        else:
            for index in range(experts):
                target.quantize_(index, source[index : index + 1, rows, :][0])
        return
    if isinstance(target, DTensor):
        local, region = target.to_local(), local_region(target)
    else:
        local, region = target, tuple(slice(0, size) for size in target.shape)
    if part.index is not None:
        first = region[0]
        if not first.start <= part.index < first.stop:
            return
        local, region = local[part.index - first.start], region[1:]
    if part.rows is not None:
        rows = region[-2]
        region = (*region[:-2], slice(rows.start + offset, rows.stop + offset), region[-1])
    local.copy_(source[region])


def check_step_checkpoint(path: Path) -> Metadata:
    """The ``torch.distributed.checkpoint`` metadata of the step checkpoint ``path``, once it is known to be complete
    (its marker), its metadata readable (with only DCP's own classes: nothing in it runs) and every file it indexes
    whole (by size).

    Raises:
        UserError: an incomplete checkpoint, or a missing, truncated or unreadable file; the message names it.
    """
    if not is_complete(path):
        raise UserError(
            f"{path}: not a complete step checkpoint (no {COMPLETE_MARKER} marker: its writing was interrupted)"
        )
    return _check_tensors(path, {})  # the metadata and the files' sizes; no tensors to compare yet


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded weights of a (possibly FSDP-sharded) model on rank zero's CPU; empty on other ranks.

    A collective under FSDP: every rank must call it. For small state (adapters); export a whole model with
    :meth:`HFCheckpointer.export`, which never gathers it.
    """
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
