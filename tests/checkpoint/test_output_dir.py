"""What a run may write into and clear: ``start_run`` checks, ``claim_output_dir`` clears. Each refusal is one
line naming the key and the path, and leaves every file of the folder as it was."""

import errno
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from toolkit.errors import UserError
from toolkit.training import claim_output_dir, start_run
from toolkit.checkpoint.output_dir import check_writable_folder

REPO = Path(__file__).resolve().parents[2]


def tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` by path: a file's SHA-256, ``dir``, or a link's target (links not followed)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            key = str(path.relative_to(folder))
            if path.is_symlink():
                found[key] = "-> " + os.readlink(path)
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def finished_run(folder: Path) -> Path:
    """The files a finished run leaves (contents stand-ins)."""
    (folder / "checkpoints" / "step_2").mkdir(parents=True)
    (folder / "checkpoints" / "step_2" / "COMPLETE").write_text('{"step": 2}\n')
    (folder / "final").mkdir()
    (folder / "final" / "model.safetensors").write_bytes(b"weights")
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (folder / "config.yaml").write_text("seed: 0\n")
    (folder / ".job").write_text("agent-1")
    return folder


@pytest.fixture
def run(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    return finished_run(tmp_path / "run")


def refused(output_dir: Path, match: str, *, watch: Path | None = None, **kwargs) -> str:
    """start_run and claim_output_dir both refuse, in one line matching ``match``, and change nothing in ``watch``
    (default: ``output_dir``)."""
    watch = watch or output_dir
    before = tree(watch) if watch.is_dir() else None
    kwargs.setdefault("overwrite", True)
    with pytest.raises(UserError, match=match) as start:
        start_run(output_dir, resume_from=None, **kwargs)
    with pytest.raises(UserError, match=match):
        claim_output_dir(output_dir, **kwargs)
    assert "\n" not in str(start.value)
    assert (tree(watch) if watch.is_dir() else None) == before, "nothing changed"
    return str(start.value)


@pytest.mark.parametrize("value", ["flase", "true", 1, None])
def test_overwrite_must_be_a_boolean(run, value):
    message = refused(run, "overwrite: must be true or false", overwrite=value)
    assert repr(value) in message
    with pytest.raises(UserError, match="overwrite: must be true or false"):  # resuming too
        start_run(run, overwrite=value, resume_from="auto")


def test_overwrite_clears_every_entry_of_a_run_and_only_links_not_their_targets(run, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours to delete")
    (run / "tensorboard").symlink_to(outside, target_is_directory=True)
    (run / ".final.partial").mkdir()  # an interrupted export
    (run / "metrics.jsonl.tmp").write_text("")  # an interrupted truncation
    assert start_run(run, overwrite=True, resume_from=None) is None
    claim_output_dir(run, overwrite=True)
    assert sorted(p.name for p in run.iterdir()) == [".job"]
    assert (outside / "keep.txt").read_text() == "not ours to delete"


@pytest.mark.parametrize(
    "entry, named",
    [("notes.txt", "notes.txt"), ("data/train.jsonl", "data"), ("checkpoints/llama/model.safetensors", "checkpoints/llama")],
)
def test_overwrite_never_clears_a_folder_that_holds_what_no_run_writes(run, entry, named):
    (run / entry).parent.mkdir(parents=True, exist_ok=True)
    (run / entry).write_text("the user's")
    message = refused(run, f"output_dir: {run} holds {named}, which is not a run's")
    assert "metrics.jsonl, config.yaml, checkpoints, final" in message  # what a run is


def test_without_run_markers_nothing_is_cleared_and_foreign_files_stay(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("kept")
    assert start_run(folder, overwrite=True, resume_from=None) is None
    claim_output_dir(folder, overwrite=True)
    assert sorted(p.name for p in folder.iterdir()) == [".job", "notes.txt"]


def test_a_base_checkpoint_inside_the_folder_is_refused_even_through_a_link(run, tmp_path):
    message = refused(run, "checkpointer.checkpoint_dir: .* is inside output_dir", base_checkpoint=run / "final")
    assert str(run / "final") in message
    link = tmp_path / "base_link"
    link.symlink_to(run / "checkpoints" / "step_2", target_is_directory=True)
    refused(run, "checkpointer.checkpoint_dir: .*base_link is inside output_dir", base_checkpoint=link)
    # The folder itself reached through a link
    alias = tmp_path / "alias"
    alias.symlink_to(run, target_is_directory=True)
    refused(alias, "is inside output_dir", base_checkpoint=run / "final")
    # Without overwrite the run is refused anyway (it holds one); a base elsewhere is fine.
    assert start_run(run, overwrite=True, resume_from=None, base_checkpoint=tmp_path / "base") is None


def test_the_current_home_root_and_project_folders_are_never_a_run_folder(run, tmp_path, monkeypatch):
    monkeypatch.chdir(run)
    assert "is the current folder" in refused(Path("."), "output_dir: ")
    assert "is a folder above the current folder" in refused(run.parent, "output_dir: ", watch=run)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(run))
    assert "is your home folder" in refused(run, "output_dir: ")
    assert "is your home folder" in refused(Path("~"), "output_dir: ", watch=run)
    assert "is the filesystem root" in refused(Path("/"), "output_dir: ", watch=run)
    assert "the project's folder" in refused(REPO, "output_dir: ", watch=REPO / "recipe_configs")


def test_an_output_dir_that_is_a_file_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    file = tmp_path / "a_file"
    file.write_text("x")
    assert "a_file is a file (ENOTDIR" in refused(file, "output_dir: ")
    assert f"{file / 'run'} cannot be created: {file} is a file (ENOTDIR" in refused(file / "run", "output_dir: ")
    assert file.read_text() == "x"


def test_a_read_only_folder_names_the_os_error(run, monkeypatch):
    # Tests run as root, whom permissions do not stop: the OS's refusal is injected where the probe writes.
    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    message = refused(run, "output_dir: cannot write into")
    assert message == f"output_dir: cannot write into {run} (EROFS: Read-only file system)"
    with pytest.raises(UserError, match="EROFS"):  # a resumed run writes there too
        start_run(run, overwrite=False, resume_from=str(run / "checkpoints" / "step_2"))


def immutable(folder: Path):
    """Make ``folder`` immutable (``chattr +i``: even root cannot write into it), or skip the test."""
    result = subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    if result.returncode != 0:
        pytest.skip(f"chattr +i not supported here: {result.stderr.decode().strip()}")
    try:
        (folder / "probe").touch()
    except OSError:
        return
    subprocess.run(["chattr", "-i", str(folder)])
    pytest.skip("chattr +i did not stop writes here")


def test_an_immutable_folder_is_refused_for_real(run):
    immutable(run)
    try:
        assert "EPERM" in refused(run, f"output_dir: cannot write into {run}")
    finally:
        subprocess.run(["chattr", "-i", str(run)])


def test_a_folder_that_cannot_be_cleared_is_one_line(run, monkeypatch):
    import shutil

    def busy(path, *args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(shutil, "rmtree", busy)
    with pytest.raises(UserError, match=rf"output_dir: cannot clear the old run in {run} \(EACCES: Permission denied at "):
        claim_output_dir(run, overwrite=True)


def test_check_writable_folder_creates_nothing(tmp_path):
    check_writable_folder(tmp_path / "new" / "deeper")
    assert list(tmp_path.iterdir()) == []
