"""Where rows come from: local JSON, JSONL, CSV, Parquet and text files, or a dataset on the Hugging Face hub.

A source is read in one sequential pass (the builders tokenize it once and cache the result), so a JSONL, CSV,
Parquet or text file of any size is streamed and never held in memory whole. Only a ``.json`` file holding one
JSON array has to be parsed whole; a ``.json`` file that is really JSON Lines (many are) is streamed too.

Every row comes with its :class:`Location` (file and 1-based line or row number), which error messages name.
"""

import codecs
import csv
import glob
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

from toolkit.errors import UserError

# Local formats by file extension. ``text`` is one document per line; ``text_files`` one document per file.
EXTENSIONS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
FORMATS: tuple[str, ...] = ("json", "jsonl", "csv", "parquet", "text", "text_files", "hub")


class Location(NamedTuple):
    """Where a row is: its file and, unless the whole file is one row, its 1-based line or row number."""

    file: str
    unit: str  # "line", "row", or "" when the file itself is the row
    number: int

    def __str__(self) -> str:
        return f"{self.file}, {self.unit} {self.number}" if self.unit else self.file


class UnreadableRow(Exception):
    """Yielded (not raised) in place of a row that could not be parsed, so that reading can go on past it."""


RowIterator = Iterator[tuple[Location, Any]]


@dataclass(frozen=True)
class Source:
    """A readable source of rows.

    Attributes:
        name: what messages call it (a path, or ``hub:<id>``).
        fingerprint: identifies the content (paths with sizes and modification times, or the hub dataset's
            own fingerprint); part of the cache key.
        rows: starts a pass over ``(location, row)`` pairs; a row is a ``dict`` (other JSON values are passed
            on for the format to reject) or an :class:`UnreadableRow`.
    """

    name: str
    fingerprint: dict[str, Any]
    rows: Callable[[], RowIterator]


def open_source(
    source: str,
    *,
    format: str | None = None,
    split: str = "train",
    name: str | None = None,
    revision: str | None = None,
) -> Source:
    """Resolves ``source`` to local files or a hub dataset.

    Args:
        source: a file, a directory (every file in it of the format, recursively, in sorted order), a glob
            pattern, or a Hugging Face hub dataset id.
        format: one of :data:`FORMATS`; inferred from the extension when omitted (a directory of ``.txt``
            files is ``text_files``). A source that is not a local path is ``hub``.
        split: hub dataset split.
        name: hub dataset configuration name.
        revision: hub dataset revision (branch, tag or commit).

    Raises:
        UserError: on an unknown format, a missing local file, or a hub source without the ``datasets`` package.
    """
    if format is not None and format not in FORMATS:
        raise UserError(f"dataset format must be one of {', '.join(FORMATS)}; got {format!r}")
    source = str(source)
    if format == "hub":
        return _hub_source(source, split=split, name=name, revision=revision)
    paths = _local_paths(source)
    if paths is None:
        looks_local = Path(source).suffix.lower() in EXTENSIONS or source.startswith((".", "/", "~"))
        if format is not None or looks_local:
            raise UserError(f"dataset source {source!r} does not exist (no such file, directory or glob match)")
        return _hub_source(source, split=split, name=name, revision=revision, local_hint=True)
    if format is None:
        format = _infer_format(source, paths)
    if Path(source).expanduser().is_dir():
        # A folder may hold other files (a README, a license): take those of the format only.
        wanted = "text" if format == "text_files" else format
        paths = [p for p in paths if EXTENSIONS.get(p.suffix.lower()) == wanted]
    if not paths:
        raise UserError(f"dataset source {source!r} has no {format} files")
    reader = _READERS[format]
    files = [str(p) for p in paths]
    return Source(
        name=source,
        fingerprint={"format": format, "files": [_file_fingerprint(p) for p in paths]},
        rows=lambda: (item for file in files for item in reader(file)),
    )


def _local_paths(source: str) -> list[Path] | None:
    """The files ``source`` names, sorted; None if it names nothing local."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if glob.has_magic(source):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(source), recursive=True))
        return [p for p in matches if p.is_file()] or None
    return None


def _infer_format(source: str, paths: list[Path]) -> str:
    suffixes = {p.suffix.lower() for p in paths}
    formats = {EXTENSIONS[s] for s in suffixes if s in EXTENSIONS}
    if len(formats) != 1:
        found = ", ".join(sorted(suffixes)) or "none"
        raise UserError(
            f"cannot tell the format of dataset source {source!r} (extensions: {found}); set dataset.format to "
            f"one of {', '.join(f for f in FORMATS if f != 'hub')}"
        )
    (format,) = formats
    # A folder of text files is a corpus of documents, one per file; a single .txt file is one per line.
    return "text_files" if format == "text" and Path(source).expanduser().is_dir() else format


def _file_fingerprint(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _read_json(path: str) -> RowIterator:
    with open(path, "rb") as f:
        # Editors on Windows start UTF-8 files with a byte-order mark; json reads past it, so must this look.
        head = f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        # Not an array: JSON Lines under a .json name (as many hub datasets ship), read line by line.
        rows = _read_jsonl(path)
        first = next(rows, None)
        if first is not None and isinstance(first[1], UnreadableRow) and head.startswith(b"{"):
            _refuse_one_object(path)
        yield from ([first] if first is not None else [])
        yield from rows
        return
    try:
        with open(path, "rb") as f:
            rows = json.load(f)
    except ValueError as e:
        line = f", line {e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"{path}{line}: not valid JSON ({e})") from None
    for number, row in enumerate(rows, 1):
        yield Location(path, "row", number), row


def _refuse_one_object(path: str) -> None:
    """Raise a clear error if ``path`` is a single JSON object (``{"data": [...]}``) rather than rows."""
    try:
        with open(path, "rb") as f:
            value = json.load(f)
    except ValueError:
        return  # not one object either: the line-by-line reading names the first bad line
    if not isinstance(value, dict):
        return
    lists = [f"'{key}' ({len(v)} items)" for key, v in value.items() if isinstance(v, list)]
    where = f"; its list: {', '.join(lists)}" if lists else ""
    raise UserError(
        f"{path}: one JSON object, not rows: a .json dataset is an array of row objects, or one object per line "
        f"(JSON Lines){where}"
    )


def _read_jsonl(path: str) -> RowIterator:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # also invalid UTF-8 (UnicodeDecodeError is a ValueError)
                row = UnreadableRow(f"not valid JSON ({e})")
            yield Location(path, "line", number), row


def _read_csv(path: str) -> RowIterator:
    # The csv module's default cap of 128 KiB per field would reject a long document; a row is capped by
    # memory anyway.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    # utf-8-sig drops the byte-order mark that spreadsheet programs write, which would otherwise stick to the
    # first column's name.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header: list[str] | None = None
        while True:
            start = reader.line_num + 1  # a quoted field may span lines: report the line the row starts on
            try:
                fields = next(reader)
            except StopIteration:
                return
            except (csv.Error, UnicodeDecodeError) as e:
                raise UserError(f"{path}, line {start}: cannot read CSV ({e})") from None
            if not fields:  # blank line
                continue
            if header is None:
                header = fields
                continue
            location = Location(path, "line", start)
            if len(fields) != len(header):
                yield location, UnreadableRow(f"has {len(fields)} fields but the header has {len(header)}")
            else:
                yield location, dict(zip(header, fields))


def _read_parquet(path: str) -> RowIterator:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"reading {path} needs the pyarrow package: pip install pyarrow (or the tunekit[data] extra)"
        ) from None
    number = 0
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield Location(path, "row", number), row
    except OSError as e:  # pyarrow's ArrowInvalid and ArrowIOError are OSErrors
        raise UserError(f"{path}, row {number + 1}: cannot read Parquet ({e})") from None


def _read_text_lines(path: str) -> RowIterator:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield Location(path, "line", number), UnreadableRow(f"not valid UTF-8 ({e})")
                continue
            if text.strip():  # blank lines separate nothing worth training on
                yield Location(path, "line", number), {"text": text}


def _read_text_file(path: str) -> RowIterator:
    location = Location(path, "", 0)
    try:
        yield location, {"text": Path(path).read_text(encoding="utf-8")}
    except UnicodeDecodeError as e:
        yield location, UnreadableRow(f"not valid UTF-8 ({e})")


_READERS: dict[str, Callable[[str], RowIterator]] = {
    "json": _read_json,
    "jsonl": _read_jsonl,
    "csv": _read_csv,
    "parquet": _read_parquet,
    "text": _read_text_lines,
    "text_files": _read_text_file,
}


def _hub_source(
    source: str, *, split: str, name: str | None, revision: str | None, local_hint: bool = False
) -> Source:
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"dataset source {source!r} is not a local file, so it is loaded from the Hugging Face hub, which "
            "needs the datasets package: pip install datasets (or the tunekit[data] extra)"
        ) from None
    try:
        dataset = datasets.load_dataset(source, name=name, split=split, revision=revision)
    except Exception as e:  # not found, no such split or config, offline: all the user's to fix
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # A mistyped local path looks like a hub id too: say that it was looked for here first.
        local = f"; nor is it a local file or folder (under {Path.cwd()})" if local_hint else ""
        raise UserError(
            f"cannot load hub dataset {source!r} (name={name}, split={split}, revision={revision}): {message}{local}"
        ) from None
    label = f"hub:{source}" + (f"[{name}]" if name else "") + f"/{split}"

    def rows() -> RowIterator:
        for number, row in enumerate(dataset, 1):
            yield Location(label, "row", number), row

    fingerprint = {
        "format": "hub",
        "id": source,
        "name": name,
        "split": split,
        "revision": revision,
        # datasets derives it from the prepared files, so it changes when the data does.
        "datasets_fingerprint": getattr(dataset, "_fingerprint", None),
    }
    return Source(name=label, fingerprint=fingerprint, rows=rows)
