"""Where rows come from: local JSON, JSONL, CSV, Parquet and text files, or a dataset on the Hugging Face hub.

A source is read in one sequential pass (the builders tokenize it once and cache the result), so a JSONL, CSV,
Parquet or text file of any size is streamed and never held in memory whole. Only a ``.json`` file holding one
JSON array has to be parsed whole; a ``.json`` file that is really JSON Lines (many are) is streamed too.

Every row comes with its :class:`Location` (file and 1-based line or row number), which error messages name.
"""

import codecs
import csv
import difflib
import glob
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, NamedTuple

from toolkit.errors import UserError
from toolkit.paths import install_command

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
# Byte-order marks of encodings other than UTF-8 (Windows PowerShell's `>` writes UTF-16): read as UTF-8, every
# line of such a file would be garbage, so the file is refused whole. UTF-32 first: its LE mark starts like UTF-16's.
_OTHER_BOMS: tuple[tuple[bytes, str], ...] = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
# How many entries of a folder are compared with a mistyped name (a folder of a million shards stays quick).
_SUGGEST_AMONG = 10_000


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
        why_empty: says, naming the files, why a pass gave no rows at all (empty files, only blank lines, a
            CSV header alone...).
    """

    name: str
    fingerprint: dict[str, Any]
    rows: Callable[[], RowIterator]
    why_empty: Callable[[], str]


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
        UserError: on a source that is not a path, an unknown format, a missing local file (with the names close
            to it), a hub source without the ``datasets`` package, or a hub that cannot be reached.
    """
    if format is not None and format not in FORMATS:
        raise UserError(f"dataset format must be one of {', '.join(FORMATS)}; got {format!r}")
    if source is None:
        raise UserError("dataset source is not set: give dataset.source a file, folder, glob or hub dataset id")
    if isinstance(source, (list, tuple)):
        raise UserError(
            f"dataset source must be one path, not a list ({len(source)} items); put the files in one folder, or "
            "name them with a glob pattern such as data/part-*.jsonl"
        )
    if not isinstance(source, (str, os.PathLike)):
        raise UserError(f"dataset source must be a path or a hub dataset id, got {type(source).__name__} {source!r}")
    source = os.fspath(source)
    if not source:
        raise UserError("dataset source is empty: give dataset.source a file, folder, glob or hub dataset id")
    if format == "hub":
        return _hub_source(source, split=split, name=name, revision=revision)
    paths = _local_paths(source)
    if paths is None:
        looks_local = Path(source).suffix.lower() in EXTENSIONS or source.startswith((".", "/", "~"))
        if format is not None or looks_local:
            raise UserError(f"dataset source {source!r} does not exist{_missing_path_hint(source)}")
        return _hub_source(source, split=split, name=name, revision=revision, local_hint=True)
    # The hub's selectors mean nothing to local files, which are read whole: a user who set one expected another
    # dataset than the one that would be read. `split: train` is the default the hub configs spell out.
    hub_only = {"name": name, "revision": revision, "split": None if split == "train" else split}
    for key, value in hub_only.items():
        if value is not None:
            raise UserError(
                f"dataset {key}={value!r} selects from a hub dataset, but source {source!r} is a local path, read "
                f"whole; remove {key}, or split the data into files of their own"
            )
    if Path(source).expanduser().is_dir() and not paths:
        raise UserError(f"dataset source {source!r} is an empty folder")
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
        rows=lambda: (item for file in files for item in _read(reader, file)),
        why_empty=lambda: _why_files_empty(source, files, format),
    )


def _read(reader: Callable[[str], RowIterator], file: str) -> RowIterator:
    """``reader(file)``, with the operating system's refusals (permissions, a file gone since) as one line."""
    try:
        yield from reader(file)
    except OSError as e:
        raise UserError(f"cannot read dataset file {file}: {e.strerror or e}") from None


def _missing_path_hint(source: str, *, suggestions_only: bool = False) -> str:
    """For a path that does not exist: its first missing part, and the names in that folder close to it.

    Args:
        source: the path.
        suggestions_only: say nothing unless there are close names (for a source that may be a hub id).
    """
    path = Path(source).expanduser()
    folder = Path(path.anchor) if path.is_absolute() else Path(".")
    parts = path.parts[1:] if path.is_absolute() else path.parts
    for part in parts:
        if not (folder / part).exists():
            break
        folder = folder / part
    else:
        return ""
    where = "the current folder" if folder == Path(".") else str(folder)
    close = []
    if folder.is_dir() and not glob.has_magic(part):
        names = [p.name for p in itertools.islice(folder.iterdir(), _SUGGEST_AMONG) if not p.name.startswith(".")]
        # Stems too: `data/train` (no extension, so taken for a hub id) is meant as data/training.jsonl.
        by_key = {Path(name).stem: name for name in sorted(names)} | {name: name for name in names}
        matches = difflib.get_close_matches(part, sorted(by_key), n=3, cutoff=0.75)
        close = list(dict.fromkeys(by_key[key] for key in matches))
    if close:
        return f" (no {part!r} in {where}; did you mean {' or '.join(map(repr, close))}?)"
    if suggestions_only:
        return ""
    if not folder.is_dir():
        return f" ({where} is a file, not a folder)"
    if glob.has_magic(part):
        return f" (nothing in {where} matches {part!r})"
    return f" (no {part!r} in {where})"


def _why_files_empty(source: str, files: list[str], format: str) -> str:
    """Why files of ``format`` gave no rows, naming them: empty, only blank lines, a CSV header alone..."""
    reasons = [f"{file} {_why_file_empty(file, format)}" for file in files]
    if len(reasons) == 1:
        return reasons[0]
    shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
    return f"none of the {len(reasons)} files of {source!r} has a row: {shown}"


def _why_file_empty(path: str, format: str) -> str:
    try:
        if os.path.getsize(path) == 0:
            return "is empty (0 bytes)"
        with open(path, "rb") as f:
            head = f.read(1 << 16).removeprefix(codecs.BOM_UTF8).strip()
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not head:
        return "has only blank lines"
    if format == "csv":
        header = head.split(b"\n", 1)[0].decode("utf-8", errors="replace").strip()
        return f"has only its header line ({header:.100}) and no rows under it"
    if head.startswith(b"["):
        return "is an empty JSON array"
    return "has no rows"


def _refuse_other_encodings(path: str, head: bytes) -> None:
    """Raise if ``head``, a file's first bytes, is UTF-16 or UTF-32 text: a byte-order mark, then the zero bytes
    that every ASCII character has in those encodings (without them, the file is not text of any kind)."""
    for bom, encoding in _OTHER_BOMS:
        if head.startswith(bom) and b"\0" in head[len(bom) : len(bom) + 64]:
            raise UserError(
                f"{path}: the file is {encoding} (it starts with a {encoding} byte-order mark); save it as UTF-8"
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
        head = f.read(4096)
    _refuse_other_encodings(path, head)
    # Editors on Windows start UTF-8 files with a byte-order mark; json reads past it, so must this look.
    head = head.removeprefix(codecs.BOM_UTF8).lstrip()
    if not head.startswith(b"["):
        # Not an array: JSON Lines under a .json name (as many hub datasets ship), read line by line.
        rows = _read_jsonl(path)
        first = next(rows, None)
        if first is not None and isinstance(first[1], UnreadableRow) and head.startswith(b"{"):
            _refuse_one_object(path)
        yield from ([first] if first is not None else [])
        yield from rows
        return
    with open(path, "rb") as f:
        data = f.read()
    try:
        rows = json.loads(data)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}, line {e.lineno}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"{path}, line {line}: {_not_utf8(e)}") from None
    except RecursionError:
        raise UserError(f"{path}: not readable JSON (nested too deeply)") from None
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
            if number == 1:
                _refuse_other_encodings(path, line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except UnicodeDecodeError as e:
                row = UnreadableRow(_not_utf8(e))
            except ValueError as e:
                # Only the last line can lack its newline: a file whose writing was cut short.
                cut = "" if line.endswith(b"\n") else "; the file ends in the middle of this line (cut short?)"
                row = UnreadableRow(f"not valid JSON ({e}){cut}")
            except RecursionError:
                row = UnreadableRow("not readable JSON (nested too deeply)")
            yield Location(path, "line", number), row


def _not_utf8(error: UnicodeDecodeError, where: str = "") -> str:
    byte = error.object[error.start : error.start + 1].hex()
    return f"not valid UTF-8{where} (byte 0x{byte}: {error.reason}); save the file as UTF-8"


def _read_csv(path: str) -> RowIterator:
    # The csv module's default cap of 128 KiB per field would reject a long document; a row is capped by
    # memory anyway.
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
    with open(path, "rb") as f:
        # strict: a quote left open swallows every later line into one field, silently, where strict says so.
        reader = csv.reader(_utf8_lines(path, f), strict=True)
        header: list[str] | None = None
        while True:
            start = reader.line_num + 1  # a quoted field may span lines: report the line the row starts on
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as e:
                unclosed = "; a quoted field that starts here is never closed" if "end of data" in str(e) else ""
                raise UserError(f"{path}, line {start}: cannot read CSV ({e}){unclosed}") from None
            if not fields:  # blank line
                continue
            if header is None:
                twice = sorted({name for name in fields if fields.count(name) > 1})
                if twice:
                    # A row would keep only the last of the columns of one name, silently.
                    raise UserError(f"{path}, line {start}: the header names column {twice[0]!r} more than once")
                header = fields
                continue
            location = Location(path, "line", start)
            if len(fields) != len(header):
                yield location, UnreadableRow(f"has {len(fields)} fields but the header has {len(header)}")
            else:
                yield location, dict(zip(header, fields))


def _utf8_lines(path: str, f: BinaryIO) -> Iterator[str]:
    """The lines of the binary file ``f`` as text, each decoded alone so that a bad byte is named by its line.

    Line ends are kept, as the csv module asks (``newline=""``); a UTF-8 byte-order mark, which spreadsheet
    programs write, is dropped so that it does not stick to the first column's name.
    """
    for number, line in enumerate(f, 1):
        if number == 1:
            _refuse_other_encodings(path, line)
            line = line.removeprefix(codecs.BOM_UTF8)
        try:
            yield line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}, line {number}: {_not_utf8(e)}") from None


def _read_parquet(path: str) -> RowIterator:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            f"reading {path} needs the pyarrow package: pip install pyarrow (or the data extra: "
            f"{install_command('data')})"
        ) from None
    from pyarrow import ArrowException

    try:
        parquet = pq.ParquetFile(path)
    except (ArrowException, OSError) as e:  # a file that is not Parquet, or cut short: its footer is unreadable
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None
    number = 0
    try:
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield Location(path, "row", number), row
    except (ArrowException, OSError) as e:
        raise UserError(f"{path}, row {number + 1}: cannot read Parquet ({e})") from None


def _read_text_lines(path: str) -> RowIterator:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if number == 1:
                _refuse_other_encodings(path, line)
                line = line.removeprefix(codecs.BOM_UTF8)  # a mark, not text to train on
            try:
                text = line.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                yield Location(path, "line", number), UnreadableRow(_not_utf8(e))
                continue
            if text.strip():  # blank lines separate nothing worth training on
                yield Location(path, "line", number), {"text": text}


def _read_text_file(path: str) -> RowIterator:
    location = Location(path, "", 0)
    data = Path(path).read_bytes()
    _refuse_other_encodings(path, data[:128])
    try:
        yield location, {"text": data.decode("utf-8-sig")}
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        yield location, UnreadableRow(_not_utf8(e, f" at line {line}"))


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
    # A mistyped local path looks like a hub id too: every refusal says that it was looked for here first.
    local = ""
    if local_hint:
        close = _missing_path_hint(source, suggestions_only=True)
        local = f"; nor is it a local file or folder (under {Path.cwd()}){close}"
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"dataset source {source!r} is not a local file, so it is loaded from the Hugging Face hub, which "
            f"needs the datasets package: pip install datasets (or the data extra: {install_command('data')}){local}"
        ) from None
    _check_hub_reachable(source, revision=revision, local=local)
    try:
        dataset = datasets.load_dataset(source, name=name, split=split, revision=revision)
    except Exception as e:  # not found, no such split or config, offline: all the user's to fix
        raise UserError(
            f"cannot load hub dataset {source!r} (name={name}, split={split}, revision={revision}): "
            f"{_first_line(e)}{local}"
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
    return Source(name=label, fingerprint=fingerprint, rows=rows, why_empty=lambda: f"{label} has no rows")


def _check_hub_reachable(source: str, *, revision: str | None, local: str) -> None:
    """One quick request to the hub before ``load_dataset``, which retries an unreachable hub for half a minute,
    printing each retry, before it gives up.

    Raises:
        UserError: ``source`` is not a valid hub id, or the hub cannot be reached (no network, a proxy, a timeout).
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import HfHubHTTPError, HFValidationError

    if constants.HF_HUB_OFFLINE:
        return  # asked not to go online: load_dataset reads its cache, quickly, or says it has no copy
    try:
        HfApi().dataset_info(source, revision=revision, timeout=10)
    except HfHubHTTPError:
        return  # the hub answered: load_dataset says what is wrong (no such dataset, gated, private) or loads it
    except HFValidationError as e:
        raise UserError(f"dataset source {source!r} is not a hub dataset id ({_first_line(e)}){local}") from None
    except Exception as e:  # the transport's own errors (requests', httpx's) share no base class but Exception
        raise UserError(
            f"cannot reach the Hugging Face hub to load dataset {source!r} ({type(e).__name__}: {_first_line(e)})"
            f"{local}; a dataset downloaded before loads from the cache with HF_HUB_OFFLINE=1"
        ) from None


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
