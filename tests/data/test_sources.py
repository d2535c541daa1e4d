"""Sources: every local format, folders and globs, hub datasets (through a stand-in for `datasets`)."""

import codecs
import csv
import json
import sys
import types
from pathlib import Path

import pytest

from toolkit.data import chat_dataset, instruct_dataset, text_completion_dataset
from toolkit.data import sources
from toolkit.data.sources import Location, UnreadableRow, open_source
from toolkit.errors import UserError
from toolkit.tokenizers import byte_tokenizer

ROWS = [{"input": "hi", "output": "hello"}, {"input": "2+2", "output": "4"}, {"input": "a,\"b\"\nc", "output": "ok"}]


def _rows(source: str, **kwargs) -> list[tuple[str, object]]:
    return [(str(loc), row) for loc, row in open_source(source, **kwargs).rows()]


def _write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_jsonl_streams_and_numbers_lines(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps(ROWS[1]) + "\n{not json\n")
    rows = _rows(str(path))
    assert [loc for loc, _ in rows] == [f"{path}, line 1", f"{path}, line 3", f"{path}, line 4"]
    assert [row for _, row in rows[:2]] == ROWS[:2]
    assert isinstance(rows[2][1], UnreadableRow) and "not valid JSON" in str(rows[2][1])


def test_json_array_and_json_lines_named_json(tmp_path: Path) -> None:
    array = tmp_path / "a.json"
    array.write_text(json.dumps(ROWS, indent=2))
    assert _rows(str(array)) == [(f"{array}, row {i}", row) for i, row in enumerate(ROWS, 1)]
    lines = tmp_path / "l.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert _rows(str(lines)) == [(f"{lines}, line {i}", row) for i, row in enumerate(ROWS, 1)]
    broken = tmp_path / "b.json"
    broken.write_text('[\n{"input": 1},\n{oops}\n]')
    with pytest.raises(UserError, match=rf"{broken}, line 3: not valid JSON"):
        _rows(str(broken))


def test_csv_line_numbers_count_quoted_newlines(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    _write_csv(path, [ROWS[2], ROWS[0]])
    rows = _rows(str(path))
    # Header on line 1; the first row spans lines 2-3 (a quoted newline), so the second starts on line 4.
    assert rows == [(f"{path}, line 2", ROWS[2]), (f"{path}, line 4", ROWS[0])]
    with open(path, "a") as f:
        f.write("only-one-field\n")
    loc, row = _rows(str(path))[-1]
    assert loc == f"{path}, line 5" and "has 1 fields but the header has 2" in str(row)


def test_parquet(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path, row_group_size=2)
    assert _rows(str(path)) == [(f"{path}, row {i}", row) for i, row in enumerate(ROWS, 1)]


def test_parquet_without_pyarrow_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match="needs the pyarrow package: pip install pyarrow"):
        _rows(str(path))


def test_text_lines_and_text_files(tmp_path: Path) -> None:
    lines = tmp_path / "one.txt"
    lines.write_text("first doc\n\nsecond doc\r\n")
    assert _rows(str(lines)) == [
        (f"{lines}, line 1", {"text": "first doc"}),
        (f"{lines}, line 3", {"text": "second doc"}),
    ]
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_text("doc b\nstill b")
    (corpus / "sub" / "a.txt").write_text("doc a")
    (corpus / "README.md").write_text("not data")
    assert _rows(str(corpus)) == [
        (str(corpus / "b.txt"), {"text": "doc b\nstill b"}),
        (str(corpus / "sub" / "a.txt"), {"text": "doc a"}),
    ]
    # The same folder, a document per line instead.
    assert [row["text"] for _, row in _rows(str(corpus), format="text")] == ["doc b", "still b", "doc a"]


def test_folders_and_globs_of_shards(tmp_path: Path) -> None:
    for i, row in enumerate(ROWS):
        (tmp_path / f"part-{i}.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "notes.md").write_text("ignored")
    assert [row for _, row in _rows(str(tmp_path))] == ROWS
    assert [row for _, row in _rows(str(tmp_path / "part-[01].jsonl"))] == ROWS[:2]


def test_unknown_or_missing_sources(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        open_source(str(tmp_path / "missing.jsonl"))
    with pytest.raises(UserError, match="does not exist"):
        open_source("./nowhere")
    with pytest.raises(UserError, match="format must be one of"):
        open_source(str(tmp_path), format="xml")
    (tmp_path / "a.json").write_text("[]")
    (tmp_path / "b.csv").write_text("x\n")
    with pytest.raises(UserError, match="cannot tell the format"):
        open_source(str(tmp_path))
    with pytest.raises(UserError, match="has no parquet files"):
        open_source(str(tmp_path), format="parquet")


@pytest.mark.parametrize("selector", [{"name": "en"}, {"revision": "v2"}, {"split": "validation"}])
def test_a_hub_selector_on_a_local_file_is_refused(tmp_path: Path, selector: dict) -> None:
    # Local files are read whole: a split, configuration or revision would silently select nothing.
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n')
    ((key, value),) = selector.items()
    with pytest.raises(UserError, match=f"dataset {key}='{value}' selects from a hub dataset, but source") as error:
        open_source(str(path), **selector)
    assert "\n" not in str(error.value)
    assert _rows(str(path), split="train")  # the hub configs' default split stays accepted


class _FakeHubDataset(list):
    _fingerprint = "abc123"


def test_hub_source_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(path: str, *, name: str | None, split: str, revision: str | None) -> _FakeHubDataset:
        calls.append((path, name, split, revision))
        if path != "org/chat":
            raise FileNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")
        return _FakeHubDataset([
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        ])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    # The stand-in answers for the hub, which is not asked first (see test_an_unreachable_hub_is_one_quick_line).
    monkeypatch.setattr(sources, "_check_hub_reachable", lambda source, *, revision, local: None)
    source = open_source("org/chat", split="test", name="en", revision="v1")
    assert calls == [("org/chat", "en", "test", "v1")]
    assert source.fingerprint["datasets_fingerprint"] == "abc123"
    assert [str(loc) for loc, _ in source.rows()] == ["hub:org/chat[en]/test, row 1", "hub:org/chat[en]/test, row 2"]

    # Through a builder: OpenAI and ShareGPT rows become the same conversation.
    dataset = chat_dataset(byte_tokenizer(), source="org/chat", cache_dir=None)
    assert dataset[0] == dataset[1]
    with pytest.raises(UserError, match="cannot load hub dataset 'org/missing'.*doesn't exist on the Hub"):
        open_source("org/missing")
    # A mistyped local folder (`data/train` for `data/training`) looks like a hub id: the error says so.
    with pytest.raises(UserError) as info:
        open_source("data/train")
    assert str(info.value).endswith(f"doesn't exist on the Hub; nor is it a local file or folder (under {Path.cwd()})")
    with pytest.raises(UserError) as info:
        open_source("data/train", format="hub")  # asked for the hub: nothing about local files
    assert str(info.value).endswith("doesn't exist on the Hub")


def test_a_json_array_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    # Python's json reads past the mark; the check for an array must too, or the file was read as JSON Lines.
    path = tmp_path / "rows.json"
    path.write_bytes(codecs.BOM_UTF8 + json.dumps(ROWS, indent=1).encode())
    assert [row for _, row in _rows(str(path))] == ROWS


def test_a_json_file_holding_one_object_says_so(tmp_path: Path) -> None:
    path = tmp_path / "export.json"
    path.write_text(json.dumps({"version": 2, "data": ROWS}, indent=2))
    with pytest.raises(UserError) as info:
        list(_rows(str(path)))
    assert str(info.value) == (
        f"{path}: one JSON object, not rows: a .json dataset is an array of row objects, or one object per line "
        f"(JSON Lines); its list: 'data' ({len(ROWS)} items)"
    )
    # JSON Lines under a .json name still reads line by line, and a broken line is still named.
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    rows = list(_rows(str(path)))
    assert rows[0][1] == ROWS[0] and str(rows[1][0]) == f"{path}, line 2"


def test_hub_source_without_datasets_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match="needs the datasets package: pip install datasets"):
        open_source("org/some-dataset")


def test_location_formatting() -> None:
    assert str(Location("a.jsonl", "line", 3)) == "a.jsonl, line 3"
    assert str(Location("doc.txt", "", 0)) == "doc.txt"


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_every_format_gives_the_same_dataset(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"d{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".csv":
        _write_csv(path, ROWS)
    else:
        pa = pytest.importorskip("pyarrow")
        pytest.importorskip("pyarrow.parquet").write_table(pa.Table.from_pylist(ROWS), path)
    tokenizer = byte_tokenizer()
    dataset = instruct_dataset(tokenizer, source=str(path), cache_dir=None)
    assert [tokenizer.decode(dataset[i]["tokens"]) for i in range(len(dataset))] == [
        f"user{r['input']}assistant{r['output']}" for r in ROWS
    ]
    text = text_completion_dataset(tokenizer, source=str(path), column_map={"text": "output"}, cache_dir=None)
    assert [tokenizer.decode(text[i]["tokens"]) for i in range(len(text))] == [r["output"] for r in ROWS]
