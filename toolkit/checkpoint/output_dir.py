"""The run's output folder: what a run may write into, what ``overwrite`` may clear, and whose folder it is.

A recipe calls :func:`start_run` first (it checks, and changes nothing), builds everything that can fail on the
user's input, then :func:`claim_output_dir` (it clears an old run and marks the folder as this job's), so a run
that stops on a bad input leaves the folder as it was.
"""

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from toolkit.errors import UserError
from toolkit.checkpoint.step_files import (
    _STEP_DIR,
    CHECKPOINTS_DIR,
    _job_key,
    find_resume_checkpoint,
    os_error_text,
    restart_count,
)

_OWNER_FILE = ".job"  # which job a folder belongs to (see claim_output_dir)

# What a run writes into its output_dir: a folder holding anything else is not (only) a run of ours, and
# overwrite=true never clears it. The first four mark a folder as holding a run; interrupted writes leave their
# temporary names (".final.partial", ".final.old", "metrics.jsonl.tmp", ".eval.json.tmp-<pid>", and the
# ".shared-<hex>" token of toolkit.parallel.distributed.shared_filesystem).
RUN_MARKERS = ("metrics.jsonl", "config.yaml", CHECKPOINTS_DIR, "final")
# The preference recipe's reference log-probabilities, computed once (toolkit.objectives.preference).
REFERENCE_LOGPS_FILE = "reference_logps.safetensors"
RUN_FILES = (*RUN_MARKERS, _OWNER_FILE, "tensorboard", "wandb", "profile", "eval.json", REFERENCE_LOGPS_FILE)
_TEMPORARY_NAME = re.compile(r"^\.?(?P<name>.+?)(\.partial|\.old|\.tmp(-\d+)?)$")
# toolkit/checkpoint/output_dir.py -> the folder holding the toolkit package (the project's checkout)
_TOOLKIT_HOME = Path(__file__).resolve().parents[2]


def _written_by_a_run(entry: Path) -> bool:
    name = entry.name
    temporary = _TEMPORARY_NAME.match(name)
    return (
        name in RUN_FILES
        or name.startswith(".shared-")
        or (temporary is not None and temporary["name"] in RUN_FILES)
    )


def _foreign_entries(output_dir: Path) -> list[Path]:
    """What ``output_dir`` holds that no run writes (its ``checkpoints/`` holds only ``step_<N>`` folders and our
    hidden ones)."""
    foreign = [entry for entry in sorted(output_dir.iterdir()) if not _written_by_a_run(entry)]
    checkpoints = output_dir / CHECKPOINTS_DIR
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        foreign += [e for e in sorted(checkpoints.iterdir()) if not (_STEP_DIR.match(e.name) or e.name.startswith("."))]
    return foreign


def check_overwrite(overwrite: object) -> None:
    """``overwrite`` must be a boolean: a string such as ``"flase"`` would be truthy and replace a run.

    Raises:
        UserError: it is not a bool.
    """
    if not isinstance(overwrite, bool):
        raise UserError(f"overwrite: must be true or false, got {overwrite!r} ({type(overwrite).__name__})")


def check_writable_folder(folder: str | Path, *, key: str = "output_dir") -> None:
    """Check that ``folder`` is (or can be created as) a folder this process can write into, creating nothing:
    a probe file is made and removed in it, or in the nearest folder above it that exists.

    Raises:
        UserError: it is a file, a folder above it is a file, or writing there fails (read-only, permissions...);
            the message names the config key, the path and the OS error.
    """
    folder = Path(folder).expanduser().absolute()
    existing = folder
    while not (existing.exists() or existing.is_symlink()) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "is" if existing == folder else f"cannot be created: {existing} is"
        what = "a file" if existing.is_file() else "not a folder"
        raise UserError(f"{key}: {folder} {where} {what} (ENOTDIR: Not a directory); choose a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise UserError(f"{key}: cannot write into {existing} ({os_error_text(e)})") from None


def check_output_apart(output: str | Path, *, option: str, inputs: Sequence[tuple[str, str | Path]]) -> None:
    """Check that a command's ``output`` folder lies apart from each of its ``inputs``: it is not one of them, does
    not hold one (``--overwrite`` would delete it), and is not inside one, where what keeps that input would delete
    the output with it (``keep_last_n`` prunes a run's step checkpoints; a new run's ``overwrite=true`` clears them)
    or mix it into the input's files.

    Args:
        output: the folder the command writes.
        option: the option that named it (``--output``), for the message.
        inputs: ``(what, folder)`` of each folder to stay apart from, e.g. ``("the checkpoint", step_6)``.

    Raises:
        UserError: the one line names the option, the output and the input folder.
    """
    resolved = Path(output).expanduser().resolve()
    for what, folder in inputs:
        input_folder = Path(folder).expanduser().resolve()
        if resolved == input_folder or input_folder.is_relative_to(resolved):
            relation = "is" if resolved == input_folder else "holds"
            raise UserError(f"{option}: {output} {relation} {what} {folder}; choose another folder")
        if resolved.is_relative_to(input_folder):
            raise UserError(
                f"{option}: {output} is inside {what} {folder}, and would go when that is pruned, cleared or "
                "rewritten; choose a folder outside it"
            )


def check_run_folder(output_dir: str | Path) -> None:
    """Check that ``output_dir`` is a folder of a run's own: not the filesystem root, the home or current folder,
    the folder holding the toolkit (the project's checkout), nor a folder above one of them; and writable.

    Raises:
        UserError: the one line says which.
    """
    output_dir = Path(output_dir).expanduser()
    resolved = output_dir.resolve()
    special = [
        ("the current folder", Path.cwd()),
        ("the project's folder (it holds the toolkit package)", _TOOLKIT_HOME),
    ]
    with contextlib.suppress(RuntimeError, KeyError):  # no home folder known
        special.append(("your home folder", Path.home()))
    if resolved == Path(resolved.anchor):
        special.insert(0, ("the filesystem root", resolved))
    for name, folder in special:
        if folder.resolve().is_relative_to(resolved):
            above = "" if folder.resolve() == resolved else "a folder above "
            raise UserError(
                f"output_dir: {output_dir} is {above}{name}; a run writes into (and overwrite=true clears) a folder "
                "of its own: choose one such as outputs/my_run"
            )
    check_writable_folder(output_dir)


def prepare_output_dir(
    output_dir: str | Path,
    *,
    overwrite: bool,
    check_only: bool = False,
    base_checkpoint: str | Path | None = None,
    own_run: bool = False,
) -> Path:
    """Check that a fresh run may write into ``output_dir``, and (unless ``check_only``) clear an old run from it.

    A folder holding any of :data:`RUN_MARKERS` holds a run. It is refused unless ``overwrite``, which replaces
    it only when the folder is a run of ours: it holds nothing but what a run writes (:data:`RUN_FILES`; its
    ``checkpoints/`` only ``step_<N>`` folders) and not the base checkpoint the new run starts from. Clearing
    removes exactly those entries. ``own_run`` (a worker restarted by torchrun before its first checkpoint, over its
    own job's files) clears them without ``overwrite``, and keeps what else the folder held when the job started.
    ``check_only`` makes every check and touches nothing (a recipe checks first and clears once its inputs are
    built).

    Raises:
        UserError: ``overwrite`` is not a bool; the folder is not one of a run's own or not writable (see
            :func:`check_run_folder`); it holds a run and ``overwrite`` is off; or ``overwrite`` would delete what
            is not a run's, or the base checkpoint.
    """
    check_overwrite(overwrite)
    output_dir = Path(output_dir).expanduser()
    check_run_folder(output_dir)
    entries = sorted(output_dir.iterdir()) if output_dir.is_dir() else []
    markers = [entry.name for entry in entries if entry.name in RUN_MARKERS]
    if markers and not (overwrite or own_run):
        raise UserError(
            f"output_dir: {output_dir} already holds a run ({markers[0]}); "
            "pass overwrite=true to replace it, or choose another output_dir"
        )
    if markers and not own_run:
        base = Path(base_checkpoint).expanduser().resolve() if base_checkpoint is not None else None
        if base is not None and base.is_relative_to(output_dir.resolve()):
            raise UserError(
                f"checkpointer.checkpoint_dir: {base_checkpoint} is inside output_dir {output_dir}, which "
                "overwrite=true would clear; copy the base checkpoint elsewhere or choose another output_dir"
            )
        foreign = _foreign_entries(output_dir)
        if foreign:
            raise UserError(
                f"output_dir: {output_dir} holds {foreign[0].relative_to(output_dir)}, which is not a run's; "
                f"overwrite=true replaces only a folder holding nothing but a run ({', '.join(RUN_FILES)}): "
                "move it, or choose another output_dir"
            )
    if check_only:
        return output_dir
    try:
        if markers:
            for entry in entries:
                if not _written_by_a_run(entry):
                    continue  # only when own_run: what the folder held before this job started
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()  # a file, or a link (never what it points to)
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        where = e.filename or output_dir
        raise UserError(
            f"output_dir: cannot clear the old run in {output_dir} ({os_error_text(e)} at {where})"
        ) from None
    return output_dir


def start_run(
    output_dir: str | Path, *, overwrite: bool, resume_from: str | None, base_checkpoint: str | Path | None = None
) -> Path | None:
    """The checkpoint to resume from (None: a fresh start), having checked that the run may use ``output_dir``.

    Run it on rank zero (``on_rank_zero``), first thing. It changes nothing (only a probe file is made and removed,
    to know the folder is writable): a fresh start then calls :func:`claim_output_dir` once everything that can fail
    on the user's input (model, weights, tokenizer, data, eval tasks, metric loggers) is built, so a run that stops
    on a bad input leaves an old run in the folder as it was, even with ``overwrite``. ``base_checkpoint`` (the
    run's ``checkpointer.checkpoint_dir``) must not be inside a folder that ``overwrite`` would clear. Resuming
    leaves the folder as it is (the metrics log is cut back to the checkpoint's step once it has loaded).

    Raises:
        UserError: ``overwrite`` is not a bool; ``resume_from`` is not a complete checkpoint; ``output_dir`` is not
            a writable folder of its own; or it holds a run that may not be replaced (see
            :func:`prepare_output_dir`).
    """
    check_overwrite(overwrite)
    resume = find_resume_checkpoint(resume_from, output_dir)
    if resume is None:
        prepare_output_dir(
            output_dir, overwrite=overwrite, own_run=_own_folder(output_dir), base_checkpoint=base_checkpoint,
            check_only=True,
        )
    else:
        check_run_folder(output_dir)  # a resumed run writes there too
    return resume


def claim_output_dir(output_dir: str | Path, *, overwrite: bool, base_checkpoint: str | Path | None = None) -> None:
    """For a fresh start (:func:`start_run` returned None), before the run's first write: clear what an old run
    wrote into ``output_dir`` (``overwrite``), with the same checks as :func:`start_run`, and mark the folder as
    this job's. A worker restarted by torchrun before its first checkpoint starts afresh over its own job's files.
    Run it on rank zero (``on_rank_zero``).

    Raises:
        UserError: as :func:`start_run`, or the folder could not be cleared or written (the OS error named).
    """
    prepare_output_dir(
        output_dir, overwrite=overwrite, own_run=_own_folder(output_dir), base_checkpoint=base_checkpoint
    )
    owner = Path(output_dir).expanduser() / _OWNER_FILE
    try:
        owner.write_text(_job_key())
    except OSError as e:
        raise UserError(f"output_dir: cannot write {owner} ({os_error_text(e)})") from None


def _own_folder(output_dir: str | Path) -> bool:
    # A restarted worker's folder holds its own job's files (marked by claim_output_dir), not another run's.
    owner = Path(output_dir).expanduser() / _OWNER_FILE
    return restart_count() > 0 and owner.is_file() and owner.read_text() == _job_key()
