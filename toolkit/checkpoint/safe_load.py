"""Reading checkpoint files without running code from them (design promise 6).

A pickle names the functions its loading calls, so unpickling a crafted file runs whatever it likes. Our weights
are safetensors, but a step checkpoint is torch.distributed.checkpoint's (DCP) format, whose reader unpickles the
``.metadata`` file with plain ``pickle.load`` and every non-tensor value (an optimizer's ``lr``, ``betas``...) with
``torch.load(weights_only=False)``; only its tensors are read with ``weights_only=True``. Here the metadata is
unpickled with only the classes DCP writes into it allowed (:class:`SafeFileSystemReader`), and the values with
``torch.load(weights_only=True)`` (:class:`SafeLoadPlanner`); every read of a DCP folder in this project goes through
them (``step_checkpoint.load_dcp`` and :func:`read_dcp_metadata`). The other pickles a loader touches (Meta
``consolidated.*.pth``, a step checkpoint's RNG states) go through :func:`torch_load`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

# Every global a DCP .metadata names, as recorded from the checkpoints this project writes (full and adapter-only;
# one process, DDP, ZeRO-1/2/3 and async saves; AdamW, SGD, torchao's AdamW8bit, the step in backward; fp32, bf16 and
# fp16-mixed) with torch 2.13, and torch's dtypes and layouts, which pickle by name. A torch that writes another
# class into its metadata has it refused by name; it belongs here once checked to be plain data.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # a lookup of torch's layouts by name, e.g. "torch.strided"
    # StorageMeta.checkpoint_id, the folder it was written to (the module is pathlib._local on Python 3.13).
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class RefusedPickle(pickle.UnpicklingError):
    """A checkpoint file holds an object its format never does; it was not loaded.

    Args:
        message: what was refused, and where.
        index: for a value in a DCP shard file, its place in the checkpoint's index (to name the file).
    """

    def __init__(self, message: str, index: MetadataIndex | None = None) -> None:
        super().__init__(message)
        self.index = index


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        # A dtype or layout: looked up in torch's namespace as it is, importing nothing (torch's own __getattr__
        # would import submodules).
        value = vars(torch).get(name) if module == "torch" else None
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return value
        raise RefusedPickle(
            f"it names {module}.{name}, not one of the classes torch.distributed.checkpoint writes into a checkpoint's "
            "metadata (unpickling it could run code)"
        )


def _refusal(error: pickle.UnpicklingError) -> str:
    """What ``torch.load(weights_only=True)`` refused, from its message (the first line of which advises
    ``weights_only=False``: never for a file that may run code)."""
    lines = [line.strip() for line in str(error).splitlines()[1:]]
    reason = " ".join(line for line in lines if line and not line.startswith("Check the documentation"))
    # What follows "Please use" is how to allow the global: not for a file that may run code either.
    reason = reason.split("WeightsUnpickler error:")[-1].split(" Please use")[0].strip().rstrip(".")
    return reason or "an object that is not plain data"


def torch_load(file: Path, **kwargs: Any) -> Any:
    """``torch.load(file, weights_only=True, **kwargs)``: tensors and plain data only, nothing in the file runs.

    Raises:
        RefusedPickle: the file holds other objects (one line naming the file and what was refused).
        OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError: the file is unreadable or corrupt.
    """
    with warnings.catch_warnings():
        # A plain pickle (not torch.save's zip) draws a warning about its protocol: the refusal says enough.
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        try:
            return torch.load(file, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            if not str(e).startswith("Weights only load failed"):
                raise
            raise _refused(f"{file}: not loaded", e) from None


def _refused(where: str, error: pickle.UnpicklingError, index: MetadataIndex | None = None) -> RefusedPickle:
    return RefusedPickle(
        f"{where}: it holds more than tensors and plain data ({_refusal(error)}); a checkpoint's files are read "
        "with torch.load(weights_only=True), so that nothing in them runs", index,
    )


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` whose metadata is unpickled with only DCP's own classes allowed."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The folder's ``.metadata`` (or a rank's own, ``__<rank>.metadata``, as DCP asks).

        Raises:
            RefusedPickle: the file names another class or function (the message names the file).
        """
        rank = kwargs.get("rank")
        path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
        with self.fs.create_stream(path, "rb") as file:
            try:
                metadata = _MetadataUnpickler(file).load()
            except RefusedPickle as e:
                raise RefusedPickle(f"{path}: not loaded: {e}") from None
        if not isinstance(metadata, Metadata):
            raise RefusedPickle(
                f"{path}: not loaded: it holds a {type(metadata).__name__}, not a checkpoint's metadata"
            )
        if metadata.storage_meta is None:  # as DCP's own reader: written by an older torch
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's reading of the shard files, where a refused value (:class:`SafeLoadPlanner`) names its file."""
        try:
            return super().read_data(plan, planner)
        except RefusedPickle as e:
            if e.index is None or e.index not in self.storage_data:
                raise
            raise RefusedPickle(f"{Path(self.path) / self.storage_data[e.index].relative_path}: {e}") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, whose non-tensor values are read with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refused(f"the value of {fqn!r} was not loaded", e, read_item.storage_index) from None
        # As DefaultLoadPlanner.load_bytes, which differs only in weights_only=False.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def read_dcp_metadata(path: Path) -> Metadata:
    """The ``.metadata`` of the DCP folder ``path``, read with only DCP's own classes allowed.

    Raises:
        RefusedPickle: the file names another class or function.
        OSError, pickle.UnpicklingError...: the file is missing, unreadable or corrupt.
    """
    return SafeFileSystemReader(str(path)).read_metadata()

