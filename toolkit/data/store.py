"""Tokenized samples as three flat arrays, built in one streaming pass over a source and cached on disk.

Tokenizing once, before training, means the training loop only slices memory-mapped arrays: the accelerator never
waits for a tokenizer, start-up after the first run is instant, and every bad row is found (and reported) before
the first step rather than an hour in. The cache key is a fingerprint of the source (paths, sizes, modification
times, or the hub dataset's fingerprint), the tokenizer and every option that changes the result.

On disk, a store is a folder ``<cache_dir>/<key>/`` holding ``tokens.bin`` (int32), ``mask.bin`` (uint8, 1 where
the token is trained on), ``offsets.bin`` (int64, samples + 1), for builders that label their samples ``tags.bin``
(int8, one per sample: a KTO row's desirable flag) and ``meta.json``. It is written under a temporary
name and renamed when complete, so a crashed build never leaves a half store behind; a file lock makes the
processes of a node (torchrun ranks) build it once and the others wait and load it.
"""

import hashlib
import json
import logging
import os
import shutil
from array import array
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch

from toolkit.data.formats import BadRowError
from toolkit.data.sources import Source, UnreadableRow
from toolkit.errors import UserError

logger = logging.getLogger("toolkit.data")

# Part of every cache key: bump it when the layout or the content the builders write changes.
CACHE_VERSION = 1
# The default cache folder; `cache_dir: null` in a config turns caching off.
DEFAULT_CACHE_DIR = "~/.cache/tunekit/datasets"
# How many bad rows a report quotes.
_EXAMPLES = 5
# Tokens buffered before a write to disk (x 5 bytes each).
_FLUSH_TOKENS = 1 << 22

Sequence = tuple[list[int], list[bool]]  # tokens and their "trained on" mask
TaggedSequence = tuple[list[int], list[bool], int]  # and the sample's tag (an int8 label), for tagged builds


@dataclass
class BuildReport:
    """What a build pass found.

    Attributes:
        rows: rows read from the source.
        skipped: bad rows skipped (``skip_bad_rows``).
        skipped_examples: the first few skipped rows, each ``"<file>, line <n>: <reason>"``.
        truncated: sequences cut to ``max_seq_len``.
    """

    rows: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    truncated: int = 0


class TokenStore:
    """Samples as flat ``tokens`` (int32), ``mask`` (uint8) and ``offsets`` (int64, ``len + 1``) tensors.

    A store opened from disk is memory-mapped; pickling it (DataLoader workers started by spawn) sends only its
    path, and each process maps the files itself. ``tags`` (int8, one per sample) is there for tagged builds
    (:func:`build_store` with ``tagged=True``), else None.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor,
        offsets: torch.Tensor,
        *,
        report: BuildReport,
        path: Path | None = None,
        tags: torch.Tensor | None = None,
    ) -> None:
        self.tokens = tokens
        self.mask = mask
        self.offsets = offsets
        self.report = report
        self.path = path
        self.tags = tags

    @classmethod
    def open(cls, path: Path) -> "TokenStore":
        """Memory-maps a store written by :func:`build_store`."""
        meta = json.loads((path / "meta.json").read_text())
        num_samples, num_tokens = meta["num_samples"], meta["num_tokens"]
        return cls(
            _map(path / "tokens.bin", num_tokens, torch.int32),
            _map(path / "mask.bin", num_tokens, torch.uint8),
            _map(path / "offsets.bin", num_samples + 1, torch.int64),
            report=BuildReport(**meta["report"]),
            path=path,
            tags=_map(path / "tags.bin", num_samples, torch.int8) if meta.get("tagged") else None,
        )

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def sample(self, index: int) -> tuple[list[int], list[bool]]:
        """Tokens and "trained on" mask of sample ``index``."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end].tolist(), self.mask[start:end].bool().tolist()

    def lengths(self) -> torch.Tensor:
        """Tokens per sample (int64)."""
        return self.offsets[1:] - self.offsets[:-1]

    def cached_arrays(self, name: str, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Int64 arrays derived from this store (a packing plan), computed once and kept next to it on disk.

        Args:
            name: names the files, ``<name>-<key>.bin``; must change whenever ``compute``'s result would.
            compute: returns the arrays by key.
        """
        if self.path is None:
            return compute()
        meta = self.path / f"{name}.json"
        if meta.exists():
            try:
                sizes = json.loads(meta.read_text())
                return {key: _map(self.path / f"{name}-{key}.bin", size, torch.int64) for key, size in sizes.items()}
            except (OSError, ValueError, RuntimeError, AttributeError) as e:  # damaged: computed and written again
                logger.warning("the cached %s in %s cannot be read (%s); computing it again", name, self.path, e)
        arrays = {key: value.to(torch.int64) for key, value in compute().items()}
        # Each file is written aside and renamed, the sizes last: processes racing here write identical content,
        # and a reader sees either no plan or a whole one.
        try:
            for key, value in arrays.items():
                _write_atomic(self.path / f"{name}-{key}.bin", lambda f, v=value: array("q", v.tolist()).tofile(f))
            sizes = {key: value.numel() for key, value in arrays.items()}
            _write_atomic(meta, lambda f: f.write(json.dumps(sizes).encode()))
        except OSError as e:
            raise UserError(
                f"cannot write the {name} plan in the dataset cache {self.path} ({e.strerror or e}); set "
                "dataset.cache_dir to a writable folder"
            ) from None
        return arrays

    def __getstate__(self) -> dict[str, Any]:
        if self.path is None:
            return self.__dict__
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        if set(state) == {"path"}:
            state = TokenStore.open(state["path"]).__dict__
        self.__dict__.update(state)


def _write_atomic(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
    os.replace(tmp, path)


def _map(path: Path, size: int, dtype: torch.dtype) -> torch.Tensor:
    # shared=False maps the file privately: read lazily, shared between forked workers, never written back.
    return torch.from_file(str(path), shared=False, size=size, dtype=dtype)


class _Writer:
    """Appends sequences (and, ``tagged``, their tags) to in-memory arrays, spilling them to files when building on
    disk."""

    def __init__(self, directory: Path | None, *, tagged: bool = False) -> None:
        self.tokens, self.mask, self.offsets, self.tags = array("i"), array("B"), array("q", [0]), array("b")
        self.tagged = tagged
        self.num_tokens = 0
        self.num_samples = 0
        self._files: dict[str, BinaryIO] = {}
        if directory is not None:
            self._files = {name: open(directory / f"{name}.bin", "wb") for name in self._arrays()}

    def _arrays(self) -> tuple[str, ...]:
        return ("tokens", "mask", "offsets", "tags") if self.tagged else ("tokens", "mask", "offsets")

    def add(self, tokens: list[int], mask: list[bool], tag: int | None = None) -> None:
        self.tokens.extend(tokens)
        self.mask.extend(mask)
        if self.tagged:
            self.tags.append(tag)
        self.num_tokens += len(tokens)
        self.num_samples += 1
        self.offsets.append(self.num_tokens)
        if self._files and len(self.tokens) >= _FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for name in self._arrays():
            buffer = getattr(self, name)
            buffer.tofile(self._files[name])
            del buffer[:]

    def finish(self, report: BuildReport, path: Path | None) -> TokenStore:
        if not self._files:
            tensors = (
                torch.frombuffer(self.tokens, dtype=torch.int32),
                torch.frombuffer(self.mask, dtype=torch.uint8),
                torch.frombuffer(self.offsets, dtype=torch.int64),
            )
            tags = torch.tensor(self.tags.tolist(), dtype=torch.int8) if self.tagged else None
            return TokenStore(*tensors, report=report, tags=tags)
        self._flush()
        for f in self._files.values():
            f.close()
        assert path is not None
        meta = {"num_samples": self.num_samples, "num_tokens": self.num_tokens, "report": asdict(report),
                "tagged": self.tagged}
        (path / "meta.json").write_text(json.dumps(meta, indent=1))
        return TokenStore.open(path)

    def close(self) -> None:
        for f in self._files.values():
            f.close()


def build_store(
    source: Source,
    encode: Callable[[Any], list[Sequence] | list[TaggedSequence]],
    *,
    max_seq_len: int | None,
    truncation: bool,
    skip_bad_rows: bool,
    directory: Path | None = None,
    tagged: bool = False,
) -> TokenStore:
    """Tokenizes every row in one pass.

    Args:
        source: where the rows come from.
        encode: turns a row into one or more sequences (two for a preference pair); raises
            :class:`~toolkit.data.formats.BadRowError` (or the tokenizer's ``UserError``) for a bad row.
        max_seq_len: longest sequence kept, or ``None`` for no limit.
        truncation: cut longer sequences to ``max_seq_len``; if False, such a row is bad.
        skip_bad_rows: skip bad rows (counted in the report) instead of stopping at the first.
        directory: write the arrays into this (existing, empty) folder and map them; ``None`` keeps them in memory.
        tagged: ``encode`` gives each sequence a tag, ``(tokens, mask, tag)`` with an int8 ``tag`` (a label of the
            sample: a KTO row's desirable flag), kept as the store's ``tags``.

    Raises:
        UserError: at the first bad row unless ``skip_bad_rows``, naming the file, the row and the reason; or
            when no row gave a sample, saying why (empty files, only blank lines, every row bad).
    """
    report = BuildReport()
    writer = _Writer(directory, tagged=tagged)
    try:
        for location, row in source.rows():
            report.rows += 1
            try:
                sequences = _checked(row, encode, max_seq_len=max_seq_len, truncation=truncation, report=report)
            except (BadRowError, UserError) as e:
                message = f"{location}: {e}"
                if not skip_bad_rows:
                    raise UserError(f"{message} (fix the row, or set skip_bad_rows: true to skip bad rows)") from None
                report.skipped += 1
                if len(report.skipped_examples) < _EXAMPLES:
                    report.skipped_examples.append(message)
                continue
            for tokens, mask, *tag in sequences:
                writer.add(tokens, mask, *tag)
    except BaseException:
        writer.close()
        raise
    if writer.num_samples == 0:
        writer.close()
        if report.rows == 0:
            raise UserError(f"the dataset has no rows: {source.why_empty()}")
        raise UserError(
            f"the dataset has no usable rows: all {report.rows} rows of {source.name} are bad and were skipped "
            f"(skip_bad_rows: true); the first: {report.skipped_examples[0]}"
        )
    return writer.finish(report, directory)


def _checked(
    row: Any, encode: Callable[[Any], list[Sequence] | list[TaggedSequence]], *, max_seq_len: int | None,
    truncation: bool, report: BuildReport,
) -> list[Sequence] | list[TaggedSequence]:
    if isinstance(row, UnreadableRow):
        raise BadRowError(str(row))
    checked = []
    truncated = 0
    for tokens, mask, *tag in encode(row):
        if not tokens:
            raise BadRowError("tokenizes to no tokens")
        # The first token is never a target (labels are shifted): a sample must train on a later one, or it only
        # costs compute (and a batch of such samples has no loss at all).
        if not any(mask[1:]):
            raise BadRowError("has no token to train on (a conversation needs an assistant message)")
        if max_seq_len is not None and len(tokens) > max_seq_len:
            if not truncation:
                raise BadRowError(
                    f"{len(tokens)} tokens, more than max_seq_len {max_seq_len} (set truncation: true to cut "
                    "such samples, or raise max_seq_len)"
                )
            first = mask.index(True, 1)
            if first >= max_seq_len:
                raise BadRowError(
                    f"cut to max_seq_len {max_seq_len}, it keeps no token to train on (the first is token "
                    f"{first + 1} of {len(tokens)}); raise max_seq_len"
                )
            tokens, mask = tokens[:max_seq_len], mask[:max_seq_len]
            truncated += 1
        checked.append((tokens, mask, *tag))
    # Counted only once the whole row is good, so a skipped row adds nothing.
    report.truncated += truncated
    return checked


def fingerprint(inputs: dict[str, Any]) -> str:
    """The cache key of a build: a hash of everything that determines its result."""
    text = json.dumps({"version": CACHE_VERSION, **inputs}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cached_store(
    key_inputs: dict[str, Any], build: Callable[[Path | None], TokenStore], *, cache_dir: str | None
) -> tuple[TokenStore, bool]:
    """Loads the store for ``key_inputs`` from the cache, or builds (and caches) it.

    Args:
        key_inputs: everything the result depends on (see :func:`fingerprint`); also saved as ``inputs.json``.
        build: builds the store into the folder it is given (``None``: in memory).
        cache_dir: the cache folder, or ``None`` to build in memory every time.

    Returns:
        ``(store, hit)``, ``hit`` True when it came from the cache.
    """
    if cache_dir is None:
        return build(None), False
    root = Path(cache_dir).expanduser()
    key = fingerprint(key_inputs)
    final = root / key
    if (cached := _open_cached(final)) is not None:
        return cached, True
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the dataset cache folder {root} ({e}); set dataset.cache_dir") from None
    try:
        with _file_lock(root / f"{key}.lock"):
            # Another process (a torchrun rank on this node) may have built it while this one waited.
            if (cached := _open_cached(final, warn=False)) is not None:  # warned above if damaged
                return cached, True
            tmp = root / f"{key}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            try:
                (tmp / "inputs.json").write_text(json.dumps(key_inputs, indent=1, sort_keys=True, default=repr))
                build(tmp)
                shutil.rmtree(final, ignore_errors=True)  # without a readable meta.json it is a leftover, not a store
                os.replace(tmp, final)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # a read-only or full disk: reading the source raises UserError, not this
        raise UserError(
            f"cannot write the dataset cache in {root} ({e.strerror or e}); set dataset.cache_dir to a writable "
            "folder, or to null to tokenize in memory"
        ) from None
    logger.info("cached the tokenized dataset in %s", final)
    return TokenStore.open(final), False


def _open_cached(path: Path, *, warn: bool = True) -> TokenStore | None:
    """The store cached in ``path``; None if there is none, or if it is damaged (cut short, edited), so that it is
    built again: a cache holds nothing the source cannot give back. ``warn`` logs the damage."""
    if not (path / "meta.json").exists():
        return None
    try:
        return TokenStore.open(path)
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:  # torch.from_file: RuntimeError
        if warn:
            logger.warning("the cached dataset in %s cannot be read (%s); tokenizing the source again", path, e)
        return None


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no advisory locks (Windows): concurrent builders still each finish atomically
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        yield  # closing the file releases the lock, also when the build raises
