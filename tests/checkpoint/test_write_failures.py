"""Writes that fail (a full disk, a read-only folder) stop with one line naming the folder and the OS error, and
the previous complete checkpoint or export stays byte for byte as it was.

Tests run as root on a roomy disk, so the OS's refusal is injected: a write stream that takes a few bytes and then
fails with ENOSPC, as a filling disk does.
"""

import contextlib
import errno
import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint import filesystem

from tests.checkpoint.test_output_dir import tree
from toolkit.data import GlobalBatchSampler
from toolkit.errors import UserError
from toolkit.models.llama3 import llama3
from toolkit.training import HFCheckpointer, StepCheckpointer, TrainingState
from toolkit.checkpoint import hf as checkpointing
from toolkit.checkpoint import step_writer
from toolkit.checkpoint.step_files import COMPLETE_MARKER, latest_checkpoint

CFG = OmegaConf.create({"model": {"in_features": 4, "out_features": 3}})
ENOSPC = f"ENOSPC: {os.strerror(errno.ENOSPC)}"


class FillingDisk:
    """A write stream that takes ``room`` bytes, then fails as a full disk does."""

    def __init__(self, stream, room: int) -> None:
        self._stream, self._room = stream, room

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if len(data) > self._room:
            self._stream.write(data[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def fill_disk_in(monkeypatch, folder_name: str, room: int = 512) -> None:
    """DCP's writes into files under a folder named ``folder_name`` fail with ENOSPC after ``room`` bytes."""
    create_stream = filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def filling(self, path, mode):
        with create_stream(self, path, mode) as stream:
            yield FillingDisk(stream, room) if folder_name in Path(path).parts and "w" in mode else stream

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", filling)


def training_state(seed: int = 0) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return TrainingState(
        model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        GlobalBatchSampler(8, global_batch_size=4),
    )


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, async_save):
    checkpoints = StepCheckpointer(tmp_path, every_n_steps=1, keep_last_n=1, async_save=async_save)
    state = training_state()
    first = checkpoints.save(1, state, config=CFG)
    checkpoints.wait()
    before = tree(first)
    fill_disk_in(monkeypatch, "step_2")
    second = tmp_path / "checkpoints" / "step_2"
    message = f"{second}: cannot write the step checkpoint ({ENOSPC}); the newest complete one, {first}, is kept"
    with pytest.raises(UserError) as error:
        checkpoints.save(2, state, config=CFG)
        checkpoints.wait()  # a background write's failure is raised here
    assert str(error.value) == message
    assert tree(first) == before, "keep_last_n=1 pruned nothing: the new one never completed"
    assert not second.exists(), "the unfinished checkpoint is removed"
    assert latest_checkpoint(tmp_path) == first
    loaded = training_state(seed=1)
    assert StepCheckpointer(tmp_path, every_n_steps=1).load(first, loaded, config=CFG) == 1
    assert torch.equal(loaded.model.weight, state.model.weight)


def test_a_marker_that_cannot_be_written_leaves_the_checkpoint_incomplete_and_prunes_nothing(tmp_path, monkeypatch):
    checkpoints = StepCheckpointer(tmp_path, every_n_steps=1, keep_last_n=1)
    state = training_state()
    first = checkpoints.save(1, state, config=CFG)
    before = tree(first)
    write = step_writer._write_atomically

    def no_room_for_the_marker(path, text):
        if path.name == COMPLETE_MARKER:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write(path, text)

    monkeypatch.setattr(step_writer, "_write_atomically", no_room_for_the_marker)
    with pytest.raises(UserError, match=rf"step_2: cannot write the step checkpoint \({ENOSPC}\)"):
        checkpoints.save(2, state, config=CFG)
    assert tree(first) == before and not (tmp_path / "checkpoints" / "step_2").exists()


def test_a_read_only_folder_at_the_first_save_is_one_line(tmp_path, monkeypatch):
    checkpoints = StepCheckpointer(tmp_path, every_n_steps=1)

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(UserError) as error:
        checkpoints.save(1, training_state(), config=CFG)
    assert str(error.value) == (
        f"{tmp_path / 'checkpoints' / 'step_1'}: cannot write the step checkpoint (EROFS: Read-only file system); "
        "no earlier checkpoint was complete"
    )


def test_torchs_writer_error_on_a_full_disk_is_named_as_one(tmp_path, monkeypatch):
    # torch.save's zip writer turns a failed write into "RuntimeError: ... unexpected pos", and DCP's gathering of
    # the ranks' failures drops the OSError behind it: a full filesystem then says why.
    def torch_writer_error(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(step_writer.dcp, "save", torch_writer_error)
    checkpoints = StepCheckpointer(tmp_path, every_n_steps=1)
    with pytest.raises(RuntimeError, match="unexpected pos"):  # room on the disk: not a write refusal, a bug
        checkpoints.save(1, training_state(), config=CFG)
    full = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((*full[:4], 0, *full[5:])))  # f_bavail = 0
    with pytest.raises(UserError, match=rf"step_1: cannot write the step checkpoint \({ENOSPC}\)"):
        checkpoints.save(1, training_state(), config=CFG)


def tiny():
    return llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=16, intermediate_dim=32,
                  max_seq_len=32)


@pytest.mark.parametrize("shards", [1, 3])
def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path, monkeypatch, shards):
    checkpointer = HFCheckpointer(model_family="llama3")
    model = tiny()
    max_shard_bytes = 2**30 if shards == 1 else 12_000
    final = checkpointer.save(model, tmp_path / "final", max_shard_bytes=max_shard_bytes)
    before = tree(tmp_path)
    write = checkpointing.write_safetensors
    written = []

    def full_on_the_last_file(path, *args):
        written.append(path.name)
        if len(written) < shards:
            return write(path, *args)
        path.write_bytes(bytes(100))  # a few bytes land, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpointing, "write_safetensors", full_on_the_last_file)
    with torch.no_grad():
        model.output.weight.add_(1.0)
    with pytest.raises(UserError) as error:
        checkpointer.save(model, final, max_shard_bytes=max_shard_bytes)
    assert str(error.value) == f"{final}: cannot write the Hugging Face checkpoint ({ENOSPC}); the earlier one is kept"
    assert len(written) == shards
    assert tree(tmp_path) == before, "the earlier export is untouched and no partial folder is left"


def test_an_export_into_a_new_folder_that_fails_leaves_nothing(tmp_path, monkeypatch):
    def full(path, *args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpointing, "write_safetensors", full)
    with pytest.raises(UserError, match=rf"final: cannot write the Hugging Face checkpoint \({ENOSPC}\); nothing"):
        HFCheckpointer(model_family="llama3").save(tiny(), tmp_path / "final")
    assert list(tmp_path.iterdir()) == []
