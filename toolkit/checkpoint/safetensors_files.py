"""Hugging Face weight files (safetensors) written tensor by tensor, and the tensors an export reads to write them.

An export plans its files from the tensors' shapes alone (:func:`plan_files`), then streams each file
(:func:`write_safetensors`): no tensor but the one being written is held. What it writes comes from a
:data:`TensorReader`, over the model's state in memory (:func:`memory_reader`) or a step checkpoint's DCP files
(:func:`dcp_tensor_reader`); each written key's values are one of our tensors, a slice of a stacked one (an expert,
:class:`Source`) or several joined (a fused projection, :class:`Joined`). :class:`~toolkit.checkpoint.HFCheckpointer`
drives it.
"""

import itertools
import json
import math
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from toolkit.checkpoint.step_reader import load_dcp

SAFETENSORS_INDEX = "model.safetensors.index.json"


def files_dtype(specs: dict[str, "TensorSpec"]) -> torch.dtype | None:
    """The dtype most floating-point tensors are written in (the config's ``torch_dtype``), or None."""
    counts = Counter(spec.dtype for spec in specs.values() if spec.dtype.is_floating_point)
    return counts.most_common(1)[0][0] if counts else None


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape and dtype: all a file's header and plan need, known before any value is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorSpec":
        return cls(tuple(tensor.shape), tensor.dtype)  # a DTensor's shape is the full one

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Source:
    """Where the values of an HF tensor being written are: our tensor ``name`` (of ``spec``) whole, or its slice
    ``index`` along dim 0 (one expert of a stacked tensor)."""

    name: str
    spec: TensorSpec
    index: int | None = None

    @property
    def part_spec(self) -> TensorSpec:
        return self.spec if self.index is None else TensorSpec(self.spec.shape[1:], self.spec.dtype)

    @property
    def parts(self) -> tuple["Source", ...]:
        return (self,)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.index is None else tensor[self.index]

    def read(self, tensors: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """The values, given our tensors by name."""
        return self.take(tensors(self.name))


@dataclass(frozen=True)
class Joined:
    """An HF tensor whose rows (second-to-last dimension) are several of our whole tensors in order: a fused
    projection (Phi-3's ``qkv_proj``, our ``q_proj``, ``k_proj`` and ``v_proj``)."""

    parts: tuple[Source, ...]

    @property
    def index(self) -> None:
        return None

    @property
    def part_spec(self) -> TensorSpec:
        first = self.parts[0].spec
        rows = sum(part.spec.shape[-2] for part in self.parts)
        return TensorSpec((*first.shape[:-2], rows, first.shape[-1]), first.dtype)

    def read(self, tensors: Callable[[str], torch.Tensor]) -> torch.Tensor:
        return torch.cat([part.read(tensors) for part in self.parts], dim=-2)


def part_specs(sources: dict[str, "Source | Joined"]) -> dict[str, TensorSpec]:
    return {key: source.part_spec for key, source in sources.items()}


def plan_files(specs: dict[str, TensorSpec], max_shard_bytes: int) -> dict[str, list[str]]:
    """File name -> its keys, in order: consecutive tensors filling files of at most ``max_shard_bytes``."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, spec in specs.items():
        if groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += spec.nbytes
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i:05d}-of-{len(groups):05d}.safetensors": keys for i, keys in enumerate(groups, start=1)}


def write_index(folder: Path, files: dict[str, list[str]], specs: dict[str, TensorSpec]) -> None:
    if len(files) == 1:
        return
    index = {
        "metadata": {"total_size": sum(spec.nbytes for spec in specs.values())},
        "weight_map": {key: name for name, keys in files.items() for key in keys},
    }
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(
    path: Path, keys: list[str], specs: dict[str, TensorSpec], tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """Write a safetensors file streaming ``tensors`` (in ``keys`` order) one at a time.

    The format is an 8-byte little-endian header length, a JSON header of each tensor's dtype, shape and byte
    range, then the raw little-endian bytes; writing it directly means no tensor but the current one is held.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key in keys:
        spec = specs[key]
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[spec.dtype], "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for (key, tensor), expected in zip(tensors, keys, strict=True):
            assert key == expected and TensorSpec.of(tensor) == specs[key], f"{key}: not the planned tensor"
            f.write(tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())


# Yields ``(key, full tensor)`` for the keys asked, in their order.
TensorReader = Callable[[list[str]], Iterator[tuple[str, torch.Tensor]]]


def memory_reader(state: dict[str, torch.Tensor], sources: dict[str, "Source | Joined"]) -> TensorReader:
    return lambda keys: ((key, sources[key].read(state.__getitem__)) for key in keys)


def dcp_tensor_reader(
    checkpoint_dir: Path, sources: dict[str, "Source | Joined"], *, batch_bytes: int = 2**28
) -> TensorReader:
    """Reads full tensors out of a ``torch.distributed.checkpoint`` folder, whatever the sharding it was written
    with: each key's values from its sources there (``sources``: a saved tensor whole, one slice of it, or several
    joined). Saved tensors are loaded about ``batch_bytes`` at a time, a stacked one once for the run of its slices
    the keys ask in a row. Runs in this process alone."""

    def saved(key: str) -> dict[str, TensorSpec]:
        return {part.name: part.spec for part in sources[key].parts}

    def read(keys: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        runs = [list(run) for _, run in itertools.groupby(keys, key=lambda k: tuple(saved(k)))]
        batch: list[list[str]] = []
        for i, run in enumerate(runs):
            batch.append(run)
            size = sum(spec.nbytes for r in batch for spec in saved(r[0]).values())
            if i + 1 < len(runs) and size + sum(s.nbytes for s in saved(runs[i + 1][0]).values()) <= batch_bytes:
                continue
            wanted = {
                name: torch.empty(spec.shape, dtype=spec.dtype) for r in batch for name, spec in saved(r[0]).items()
            }
            load_dcp(wanted, checkpoint_dir, no_dist=True)
            for run_keys in batch:
                yield from ((k, sources[k].read(wanted.__getitem__)) for k in run_keys)
            batch = []

    return read
