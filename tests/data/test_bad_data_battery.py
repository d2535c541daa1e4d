"""Bad data files as users write them, through the dataset builders: each stops with one line naming the file,
the 1-based line or row, and the column, key or reason; a bad row is skipped and counted under skip_bad_rows;
a file with no rows says which file and why. Two cases go end to end through `tune run` (exit 2, one line)."""

import codecs
import json
import logging
import os
import sys
import time
import types
from pathlib import Path
from typing import Callable

import pytest

from tests.launch import run_tune
from toolkit.data import chat_dataset, instruct_dataset, kto_dataset, preference_dataset, text_completion_dataset
from toolkit.data.sources import open_source
from toolkit.errors import UserError
from toolkit.tokenizers import byte_tokenizer

TOK = byte_tokenizer()
INSTRUCT = b'{"input": "hi", "output": "yo"}'
CHAT = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}'
TEXT = b'{"text": "a document"}'
PAIR = b'{"prompt": "p", "chosen": "a", "rejected": "b"}'
UNPAIRED = b'{"prompt": "p", "completion": "a", "label": true}'
SURROGATE = "a lone UTF-16 surrogate '\\ud800' at character"


def build(builder: Callable, source: Path | str, **options) -> object:
    return builder(TOK, source=str(source), cache_dir=None, max_seq_len=64, truncation=False, **options)


def bad_line_2(path: Path, good: bytes, bad: bytes) -> Path:
    """Good rows on lines 1 and 3, the bad one on line 2."""
    path.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    return path


def msgs(*messages: str) -> bytes:
    return b'{"messages": [' + ", ".join(messages).encode() + b"]}"


# (builder, a good row, the bad row on line 2 as the file's bytes, what the message says after "<file>, line 2: ")
BAD_ROWS = {
    # A JSON escape of half a surrogate pair: json.loads accepts it, UTF-8 (so every tokenizer) cannot encode it.
    "surrogate in a column": (instruct_dataset, INSTRUCT, rb'{"input": "\ud800 x", "output": "y"}',
                              f"column 'input' has {SURROGATE} 1"),
    "surrogate in a message": (chat_dataset, CHAT, msgs(r'{"role": "user", "content": "ok \ud800"}',
                                                         '{"role": "assistant", "content": "x"}'),
                               f"message 1's 'content' has {SURROGATE} 4"),
    "surrogate in a text part": (chat_dataset, CHAT,
                                 msgs(r'{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}',
                                      '{"role": "assistant", "content": "x"}'),
                                 f"message 1's 'content' has {SURROGATE} 1"),
    "surrogate in reasoning": (chat_dataset, CHAT,
                               msgs('{"role": "user", "content": "q"}',
                                    r'{"role": "assistant", "content": "a", "reasoning_content": "\ud800"}'),
                               f"message 2's 'reasoning_content' has {SURROGATE} 1"),
    "surrogate in a document": (text_completion_dataset, TEXT, rb'{"text": "doc \udfff"}',
                                "column 'text' has a lone UTF-16 surrogate '\\udfff' at character 5"),
    "surrogate in a response": (preference_dataset, PAIR, rb'{"prompt": "p", "chosen": "\ud800", "rejected": "b"}',
                                f"column 'chosen' has {SURROGATE} 1"),
    "surrogate in a prompt": (preference_dataset, PAIR, rb'{"prompt": "\ud800", "chosen": "a", "rejected": "b"}',
                              f"column 'prompt' has {SURROGATE} 1"),
    "surrogate in ShareGPT": (chat_dataset, CHAT,
                              rb'{"conversations": [{"from": "human", "value": "\ud800"}, {"from": "gpt", "value": "x"}]}',
                              f"message 1's 'value' has {SURROGATE} 1"),
    # The same half pair written as raw bytes (CESU-8), which json decodes with surrogatepass.
    "surrogate as raw bytes": (instruct_dataset, INSTRUCT, b'{"input": "\xed\xa0\x80", "output": "y"}',
                               f"column 'input' has {SURROGATE} 1"),
    "not UTF-8": (instruct_dataset, INSTRUCT, b'{"input": "caf\xe9", "output": "y"}',
                  "not valid UTF-8 (byte 0xe9: invalid continuation byte); save the file as UTF-8"),
    "not JSON": (instruct_dataset, INSTRUCT, b'{"input": "hi", "output": }', "not valid JSON (Expecting value"),
    "nested too deeply": (instruct_dataset, INSTRUCT, b"[" * 100_000 + b"]" * 100_000,
                          "not readable JSON (nested too deeply)"),
    "row is a list": (instruct_dataset, INSTRUCT, b'["hi", "yo"]', "expected an object with named columns, got a list"),
    "row is a number": (instruct_dataset, INSTRUCT, b"42", "expected an object with named columns, got an int"),
    "row is null": (instruct_dataset, INSTRUCT, b"null", "expected an object with named columns, got null"),
    "row is a string": (instruct_dataset, INSTRUCT, b'"hi"', "expected an object with named columns, got a str"),
    "missing column": (instruct_dataset, INSTRUCT, b'{"input": "hi"}', "missing column 'output' (the row has: input)"),
    "number for text": (instruct_dataset, INSTRUCT, b'{"input": 7, "output": "y"}',
                        "column 'input' must be a string, got int"),
    "boolean for text": (instruct_dataset, INSTRUCT, b'{"input": "x", "output": true}',
                         "column 'output' must be a string, got bool"),
    "NaN for text": (instruct_dataset, INSTRUCT, b'{"input": NaN, "output": "y"}',
                     "column 'input' must be a string, got float"),
    "role missing": (chat_dataset, CHAT, msgs('{"content": "hi"}', '{"role": "assistant", "content": "x"}'),
                     "message 1 must be an object with 'role' and 'content' (OpenAI) or 'from' and 'value'"),
    "unknown role": (chat_dataset, CHAT, msgs('{"role": "human", "content": "hi"}'),
                     "message 1 has unknown role 'human' (known: system, user, assistant)"),
    "role not a string": (chat_dataset, CHAT, msgs('{"role": ["user"], "content": "hi"}'),
                          "message 1 has unknown role ['user'] (known: system, user, assistant)"),
    # An unhashable `from` used to reach a dict lookup: TypeError.
    "ShareGPT role a list": (chat_dataset, CHAT, b'{"conversations": [{"from": ["human"], "value": "x"}]}',
                             "message 1 has unknown role ['human'] (known: system, human, user, gpt, assistant)"),
    "content not a string": (chat_dataset, CHAT, msgs('{"role": "user", "content": 3}'),
                             "message 1's 'content' must be a string, got int"),
    "content null": (chat_dataset, CHAT, msgs('{"role": "user", "content": null}'),
                     "message 1's 'content' must be a string, got null"),
    "empty messages": (chat_dataset, CHAT, b'{"messages": []}', "empty conversation in column 'messages'"),
    "messages an object": (chat_dataset, CHAT, b'{"messages": {"role": "user", "content": "hi"}}',
                           "column 'messages' must be a list of messages, got dict"),
    "message a string": (chat_dataset, CHAT, b'{"messages": ["hi"]}', "message 1 must be an object with 'role'"),
    "only a user turn": (chat_dataset, CHAT, msgs('{"role": "user", "content": "hi"}'),
                         "has no token to train on (a conversation needs an assistant message)"),
    "prompt not text": (preference_dataset, PAIR, b'{"prompt": 3, "chosen": "a", "rejected": "b"}',
                        "column 'prompt' must be a string or a list of messages, got int"),
    "empty document": (text_completion_dataset, TEXT, b'{"text": ""}', "column 'text' is empty"),
    "kto label missing": (kto_dataset, UNPAIRED, b'{"prompt": "p", "completion": "a"}',
                          "missing column 'label' (the row has: prompt, completion)"),
    "kto label not a boolean": (kto_dataset, UNPAIRED, b'{"prompt": "p", "completion": "a", "label": "yes"}',
                                "column 'label' must be true (a desirable answer) or false, got str 'yes'"),
    "kto label 2": (kto_dataset, UNPAIRED, b'{"prompt": "p", "completion": "a", "label": 2}',
                    "column 'label' must be true (a desirable answer) or false, got int 2"),
    "kto completion missing": (kto_dataset, UNPAIRED, b'{"prompt": "p", "label": false}',
                               "missing column 'completion' (the row has: prompt, label)"),
    "kto pair with one answer twice": (kto_dataset, UNPAIRED, b'{"prompt": "p", "chosen": "a", "rejected": "a"}',
                                       "columns 'chosen' and 'rejected' are the same"),
    "longer than max_seq_len": (instruct_dataset, INSTRUCT, json.dumps({"input": "q", "output": "y" * 200}).encode(),
                                "222 tokens, more than max_seq_len 64 (set truncation: true to cut such samples"),
}


@pytest.mark.parametrize("builder,good,bad,reason", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_a_bad_row_stops_the_build_naming_file_line_and_field(tmp_path, builder, good, bad, reason):
    path = bad_line_2(tmp_path / "data.jsonl", good, bad)
    with pytest.raises(UserError) as info:
        build(builder, path)
    message = str(info.value)
    assert message.startswith(f"{path}, line 2: {reason}"), message
    assert message.endswith("(fix the row, or set skip_bad_rows: true to skip bad rows)")
    assert "\n" not in message


@pytest.mark.parametrize("builder,good,bad,reason", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_a_bad_row_is_skipped_and_counted_under_skip_bad_rows(tmp_path, caplog, builder, good, bad, reason):
    path = bad_line_2(tmp_path / "data.jsonl", good, bad)
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        dataset = build(builder, path, skip_bad_rows=True)
    assert len(dataset) == 2 and dataset.report.skipped == 1
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "toolkit.data"]
    assert warning.startswith(f"{path}: skipped 1 of 3 rows as bad (skip_bad_rows: true)")
    assert f"{path}, line 2: {reason}" in warning


def test_a_last_line_cut_short_says_so(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(INSTRUCT + b"\n" + INSTRUCT + b'\n{"input": "hi", "outp')
    with pytest.raises(UserError) as info:
        build(instruct_dataset, path)
    assert str(info.value).startswith(f"{path}, line 3: not valid JSON (")
    assert "the file ends in the middle of this line (cut short?)" in str(info.value)
    assert len(build(instruct_dataset, path, skip_bad_rows=True)) == 2


def test_a_lone_surrogate_in_a_json_array_names_the_row(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('[{"input": "a", "output": "b"}, {"input": "a", "output": "\\ud800"}]')
    with pytest.raises(UserError, match=rf"^{path}, row 2: column 'output' has a lone UTF-16 surrogate"):
        build(instruct_dataset, path)


# --- files without rows: which file, and why ---------------------------------------------------------------------

NO_ROWS = {
    "empty jsonl": ("data.jsonl", b"", "is empty (0 bytes)"),
    "empty json": ("data.json", b"", "is empty (0 bytes)"),
    "empty csv": ("data.csv", b"", "is empty (0 bytes)"),
    "empty txt": ("data.txt", b"", "is empty (0 bytes)"),
    "blank lines": ("data.jsonl", b"\n\n   \n\t\n", "has only blank lines"),
    "blank CRLF lines": ("data.jsonl", b"\r\n\r\n", "has only blank lines"),
    "only a byte-order mark": ("data.txt", codecs.BOM_UTF8 + b"\n", "has only blank lines"),
    "empty JSON array": ("data.json", b" [ ]\n", "is an empty JSON array"),
    "CSV header alone": ("data.csv", b"input,output\n", "has only its header line (input,output) and no rows under it"),
}


@pytest.mark.parametrize("name,content,why", NO_ROWS.values(), ids=NO_ROWS.keys())
def test_a_file_without_rows_is_named_with_the_reason(tmp_path, name, content, why):
    path = tmp_path / name
    path.write_bytes(content)
    builder = text_completion_dataset if name.endswith(".txt") else instruct_dataset
    with pytest.raises(UserError) as info:
        build(builder, path)
    assert str(info.value) == f"the dataset has no rows: {path} {why}"


def test_jsonl_read_as_csv_shows_the_header_it_found(tmp_path):
    # format: csv on a one-line JSONL file: its only line is taken for a header, and the message shows it.
    path = tmp_path / "data.jsonl"
    path.write_bytes(INSTRUCT + b"\n")
    with pytest.raises(UserError, match=r'has only its header line \(\{"input": "hi", "output": "yo"\}\)'):
        build(instruct_dataset, path, format="csv")


def test_a_folder_of_empty_shards_names_them(tmp_path):
    for i in range(5):
        (tmp_path / f"part-{i}.jsonl").write_bytes(b"" if i % 2 else b"\n")
    with pytest.raises(UserError) as info:
        build(instruct_dataset, tmp_path)
    assert str(info.value) == (
        f"the dataset has no rows: none of the 5 files of '{tmp_path}' has a row: {tmp_path}/part-0.jsonl has only "
        f"blank lines; {tmp_path}/part-1.jsonl is empty (0 bytes); {tmp_path}/part-2.jsonl has only blank lines; and "
        "2 more"
    )


def test_every_row_bad_names_the_file_and_the_first_reason(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"question": "a", "answer": "b"}\n' * 3)
    with pytest.raises(UserError) as info:
        build(instruct_dataset, path, skip_bad_rows=True)
    assert str(info.value) == (
        f"the dataset has no usable rows: all 3 rows of {path} are bad and were skipped (skip_bad_rows: true); the "
        f"first: {path}, line 1: missing column 'input' (the row has: question, answer)"
    )


def test_a_column_map_naming_a_column_the_file_lacks_says_which_key(tmp_path):
    path = bad_line_2(tmp_path / "data.jsonl", INSTRUCT, INSTRUCT)
    with pytest.raises(UserError) as info:
        build(instruct_dataset, path, column_map={"output": "answer"})
    assert str(info.value).startswith(
        f"{path}, line 1: missing column 'answer' named by column_map['output'] (the row has: input, output)"
    )
    with pytest.raises(UserError, match=r"missing column 'conv' named by column_map\['messages'\]"):
        build(chat_dataset, bad_line_2(tmp_path / "chat.jsonl", CHAT, CHAT), column_map={"messages": "conv"})


# --- encodings and line endings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["data.jsonl", "data.json", "data.csv"])
def test_a_utf16_file_is_refused_whole(tmp_path, name):
    # Windows PowerShell's `>` writes UTF-16 with a byte-order mark; read as UTF-8, each line would be garbage.
    path = tmp_path / name
    text = "input,output\nhi,yo\n" if name.endswith(".csv") else INSTRUCT.decode() + "\n"
    path.write_bytes(text.encode("utf-16"))
    with pytest.raises(UserError) as info:
        build(instruct_dataset, path)
    assert str(info.value) == f"{path}: the file is UTF-16 (it starts with a UTF-16 byte-order mark); save it as UTF-8"


@pytest.mark.parametrize(
    "name,content",
    [
        ("data.jsonl", codecs.BOM_UTF8 + INSTRUCT + b"\r\n" + INSTRUCT + b"\r\n"),
        ("data.json", codecs.BOM_UTF8 + b"[" + INSTRUCT + b",\r\n" + INSTRUCT + b"]\r\n"),
        ("data.csv", codecs.BOM_UTF8 + b"input,output\r\nhi,yo\r\nhi,yo\r\n"),
    ],
    ids=["jsonl", "json", "csv"],
)
def test_a_byte_order_mark_and_crlf_read_like_plain_utf8(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    dataset = build(instruct_dataset, path)
    assert [TOK.decode(dataset[i]["tokens"]) for i in range(len(dataset))] == ["userhiassistantyo"] * 2


def test_a_text_file_keeps_no_byte_order_mark_in_its_text(tmp_path):
    (tmp_path / "lines.txt").write_bytes(codecs.BOM_UTF8 + b"first\r\nsecond\r\n")
    lines = build(text_completion_dataset, tmp_path / "lines.txt")
    assert [TOK.decode(lines[i]["tokens"]) for i in range(2)] == ["first", "second"]
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_bytes(codecs.BOM_UTF8 + b"doc")
    assert TOK.decode(build(text_completion_dataset, tmp_path / "docs")[0]["tokens"]) == "doc"


def test_csv_that_is_not_utf8_names_the_line(tmp_path):
    # The csv module decodes ahead in 8 KiB blocks, so the line it was on used to be wrong: each line is decoded alone.
    path = tmp_path / "data.csv"
    path.write_bytes(b"input,output\n" + b"hi,yo\n" * 2000 + b"caf\xe9,y\n")
    with pytest.raises(UserError) as info:
        build(instruct_dataset, path)
    assert str(info.value) == (
        f"{path}, line 2002: not valid UTF-8 (byte 0xe9: invalid continuation byte); save the file as UTF-8"
    )


def test_a_json_array_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "data.json"
    path.write_bytes(b"[\n" + INSTRUCT + b",\n" + b'{"input": "caf\xe9", "output": "y"}\n]')
    with pytest.raises(UserError, match=rf"^{path}, line 3: not valid UTF-8 \(byte 0xe9"):
        build(instruct_dataset, path)


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path):
    # A row would silently keep only the last of the two columns.
    path = tmp_path / "data.csv"
    path.write_text("input,output,input\nhi,yo,other\n")
    with pytest.raises(UserError, match=rf"^{path}, line 1: the header names column 'input' more than once$"):
        build(instruct_dataset, path)


def test_a_file_that_is_not_parquet_is_one_line(tmp_path):
    pytest.importorskip("pyarrow")
    for name, content in [("bad.parquet", b"PAR1 not really"), ("empty.parquet", b"")]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError, match=rf"^{tmp_path / name}: not a readable Parquet file \("):
            build(instruct_dataset, tmp_path / name)


# --- where the source is ------------------------------------------------------------------------------------------


def test_a_misspelled_file_suggests_the_files_close_to_it(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_bytes(INSTRUCT + b"\n")
    (tmp_path / "data" / "notes.md").write_text("x")
    monkeypatch.chdir(tmp_path)
    cases = {
        "data/trian.jsonl": "(no 'trian.jsonl' in data; did you mean 'train.jsonl'?)",
        "data/train.json": "(no 'train.json' in data; did you mean 'train.jsonl'?)",
        "dta/train.jsonl": "(no 'dta' in the current folder; did you mean 'data'?)",
        "data/valid.jsonl": "(no 'valid.jsonl' in data)",
        "data/train.jsonl/x.jsonl": "(data/train.jsonl is a file, not a folder)",
        "data/*.csv": "(nothing in data matches '*.csv')",
    }
    for source, hint in cases.items():
        with pytest.raises(UserError) as info:
            build(instruct_dataset, source)
        assert str(info.value) == f"dataset source {source!r} does not exist {hint}"


def test_an_empty_folder_says_so(tmp_path):
    (tmp_path / "shards").mkdir()
    with pytest.raises(UserError, match=r"^dataset source '.*shards' is an empty folder$"):
        build(instruct_dataset, tmp_path / "shards")


@pytest.mark.parametrize(
    "source,message",
    [
        (None, "dataset source is not set: give dataset.source a file, folder, glob or hub dataset id"),
        ("", "dataset source is empty: give dataset.source a file, folder, glob or hub dataset id"),
        (["a.jsonl", "b.jsonl"], "dataset source must be one path, not a list (2 items); put the files in one folder"),
        (3, "dataset source must be a path or a hub dataset id, got int 3"),
    ],
    ids=["null", "empty", "list", "number"],
)
def test_a_source_that_is_no_path_is_one_line(source, message):
    # A null source used to be looked up on the hub as the dataset "None".
    with pytest.raises(UserError) as info:
        instruct_dataset(TOK, source=source, cache_dir=None)
    assert str(info.value).startswith(message)


def test_a_file_that_cannot_be_read_is_one_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(INSTRUCT + b"\n")
    source = open_source(str(path))
    path.unlink()  # gone between the look and the read (a sync job, another user)
    with pytest.raises(UserError, match=rf"^cannot read dataset file {path}: No such file or directory$"):
        list(source.rows())


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_a_file_without_read_permission_is_one_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(INSTRUCT + b"\n")
    path.chmod(0)
    with pytest.raises(UserError, match=rf"^cannot read dataset file {path}: Permission denied$"):
        build(instruct_dataset, path)


class _FakeHubDataset(list):
    _fingerprint = "f"


def _fake_datasets(monkeypatch) -> list[str]:
    loaded: list[str] = []

    def load_dataset(path: str, **kwargs) -> _FakeHubDataset:
        loaded.append(path)
        return _FakeHubDataset([json.loads(INSTRUCT)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return loaded


def test_an_unreachable_hub_is_one_quick_line(tmp_path, monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    loaded = _fake_datasets(monkeypatch)
    # Nothing listens on port 9 (discard): the connection is refused at once, as with no network.
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "training.jsonl").write_bytes(INSTRUCT + b"\n")
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        build(instruct_dataset, "data/train")
    message = str(info.value)
    assert time.monotonic() - start < 15 and not loaded  # datasets would retry for half a minute
    assert message.startswith("cannot reach the Hugging Face hub to load dataset 'data/train' (")
    assert f"; nor is it a local file or folder (under {tmp_path}) (no 'train' in data; did you mean " in message
    assert message.endswith("; a dataset downloaded before loads from the cache with HF_HUB_OFFLINE=1")
    assert "\n" not in message


def test_a_hub_that_answers_leaves_the_loading_to_datasets(monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.utils import HfHubHTTPError

    loaded = _fake_datasets(monkeypatch)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)

    class NotFound(HfHubHTTPError):
        def __init__(self) -> None:  # the real one wants an HTTP response; the check needs only the class
            Exception.__init__(self, "404 Client Error")

    def not_found(self, repo_id: str, **kwargs) -> None:
        raise NotFound()

    monkeypatch.setattr(hub.HfApi, "dataset_info", not_found)
    assert len(build(instruct_dataset, "org/data")) == 1 and loaded == ["org/data"]
    # Offline mode asks nothing of the hub: datasets reads its cache.
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub.HfApi, "dataset_info", lambda *a, **k: pytest.fail("asked the hub while offline"))
    assert len(build(instruct_dataset, "org/data")) == 1


def test_a_hub_id_that_cannot_be_one_is_one_line(monkeypatch):
    pytest.importorskip("huggingface_hub")
    _fake_datasets(monkeypatch)
    with pytest.raises(UserError, match=r"^dataset source 'my data--set' is not a hub dataset id \(.*\); nor is it"):
        build(instruct_dataset, "my data--set")


# --- options that are not what they should be ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "options,message",
    [
        ({"column_map": ["input", "output"]}, "instruct_dataset: column_map must map names to the file's column names"),
        ({"prompt_template": 3}, "prompt_template must be a string, got int 3"),
        ({"system_prompt": "be \udcff"}, "system_prompt has a lone UTF-16 surrogate '\\udcff' at character 4"),
        ({"max_seq_len": "abc"}, "max_seq_len must be a positive integer; got 'abc'"),
        ({"max_seq_len": True}, "max_seq_len must be a positive integer; got True"),
    ],
    ids=["column_map a list", "template a number", "surrogate in system_prompt", "max_seq_len text", "max_seq_len bool"],
)
def test_a_bad_builder_option_is_one_line(tmp_path, options, message):
    # A system prompt from the command line can hold a surrogate: Python decodes bytes that are not UTF-8 in argv
    # to lone surrogates.
    path = bad_line_2(tmp_path / "data.jsonl", INSTRUCT, INSTRUCT)
    with pytest.raises(UserError) as info:
        instruct_dataset(TOK, source=str(path), cache_dir=None, **options)
    assert str(info.value).startswith(message)


def test_a_long_row_is_cut_or_skipped_as_configured(tmp_path):
    path = bad_line_2(tmp_path / "data.jsonl", INSTRUCT, json.dumps({"input": "q", "output": "y" * 500}).encode())
    cut = instruct_dataset(TOK, source=str(path), cache_dir=None, max_seq_len=64)
    assert len(cut) == 3 and cut.report.truncated == 1 and len(cut[1]["tokens"]) == 64
    skipped = build(instruct_dataset, path, skip_bad_rows=True)
    assert len(skipped) == 2 and skipped.report.skipped == 1


# --- end to end: `tune run` exits 2 with one line ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,line",
    [
        (INSTRUCT + b"\n" + rb'{"input": "\ud800 x", "output": "y"}' + b"\n",
         "tune: error: {path}, line 2: column 'input' has a lone UTF-16 surrogate '\\ud800' at character 1"),
        (b"\n\n", "tune: error: the dataset has no rows: {path} has only blank lines"),
    ],
    ids=["surrogate", "blank lines"],
)
def test_tune_run_stops_with_one_line_and_exit_2(tmp_path, content, line):
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    result = run_tune(
        "run", "full_finetune_single_device", "--config", "demo", f"output_dir={tmp_path / 'out'}", "device=cpu",
        "dataset._component_=toolkit.data.instruct_dataset", f"dataset.source={path}", "~dataset.split",
        "~dataset.num_samples", "~dataset.seed", "dataset.cache_dir=null", "~eval_tasks", "~validation_dataset",
        "progress_bar=false", timeout_s=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(line.format(path=path)), result.stderr[-2000:]
    assert result.stderr.strip().count("\n") == 0, result.stderr[-2000:]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


# --- the tokenized cache: damaged or unwritable --------------------------------------------------------------------


@pytest.mark.parametrize(
    "damage",
    [
        lambda store: (store / "tokens.bin").write_bytes(b""),
        lambda store: (store / "meta.json").write_text("{oops"),
        lambda store: (store / "meta.json").write_text('{"num_samples": 2}'),
        lambda store: (store / "pack-best_fit.json").write_text("[1]"),
        lambda store: (store / "pack-best_fit-docs.bin").write_bytes(b""),
    ],
    ids=["tokens cut", "meta not JSON", "meta incomplete", "plan not sizes", "plan cut"],
)
def test_a_damaged_cache_is_built_again(tmp_path, caplog, damage):
    path = bad_line_2(tmp_path / "data.jsonl", INSTRUCT, INSTRUCT)

    def dataset():
        return instruct_dataset(TOK, source=str(path), cache_dir=str(tmp_path / "cache"), packed=True, max_seq_len=64)

    expected = dataset()[0]
    (store,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    damage(store)
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        assert dataset()[0] == expected
    (warning,) = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert str(store) in warning
    assert dataset().cache_hit  # and whole again


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    from toolkit.data import store

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.os, "replace", full_disk)
    path = bad_line_2(tmp_path / "data.jsonl", INSTRUCT, INSTRUCT)
    with pytest.raises(UserError) as info:
        instruct_dataset(TOK, source=str(path), cache_dir=str(tmp_path / "cache"))
    assert str(info.value) == (
        f"cannot write the dataset cache in {tmp_path / 'cache'} (No space left on device); set dataset.cache_dir to "
        "a writable folder, or to null to tokenize in memory"
    )
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []  # no half store left behind


# --- turn order: a matter for the chat formats that need alternation ---------------------------------------------


class _ByteEngine:
    """Bytes as ids, plus Mistral's special tokens: enough for ModelTokenizer with MistralChatFormat."""

    SPECIALS = ("<s>", "</s>", "[INST]", "[/INST]", "<pad>")
    vocab_size = 256 + len(SPECIALS)
    special_ids = {256 + i: token for i, token in enumerate(SPECIALS)}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return 256 + self.SPECIALS.index(token) if token in self.SPECIALS else None


def test_turns_out_of_order_are_a_bad_row_where_the_chat_format_needs_alternation(tmp_path):
    from toolkit.tokenizers.chat_templates import MistralChatFormat
    from toolkit.tokenizers.model_tokenizer import ModelTokenizer

    mistral = ModelTokenizer(engine=_ByteEngine(), chat_format=MistralChatFormat(), bos_token="<s>",
                             eos_token="</s>", pad_token="<pad>", stop_tokens=["</s>"])
    two_answers = msgs('{"role": "user", "content": "q"}', '{"role": "assistant", "content": "a"}',
                       '{"role": "assistant", "content": "b"}')
    path = bad_line_2(tmp_path / "data.jsonl", CHAT, two_answers)
    with pytest.raises(UserError, match=rf"^{path}, line 2: Mistral chat format needs .* in alternation"):
        chat_dataset(mistral, source=str(path), cache_dir=None)
    assert len(chat_dataset(mistral, source=str(path), cache_dir=None, skip_bad_rows=True)) == 2
    # The byte tokenizer's format has no such rule: two answers in a row are trained on as they are.
    assert len(build(chat_dataset, path)) == 3


@pytest.mark.parametrize(
    "content,message",
    [
        ('input,output\nhi,yo\nhi,"never closed\nhi,yo\nhi,yo\n',
         "line 3: cannot read CSV (unexpected end of data); a quoted field that starts here is never closed"),
        ('input,output\nhi,yo\n"hi"there,yo\n', "line 3: cannot read CSV (',' expected after '\"')"),
    ],
    ids=["quote never closed", "text after a closing quote"],
)
def test_csv_quoting_errors_name_the_line(tmp_path, content, message):
    # Read leniently, an open quote took every later line into one field: three rows became one, silently.
    path = tmp_path / "data.csv"
    path.write_text(content)
    with pytest.raises(UserError) as info:
        build(instruct_dataset, path)
    assert str(info.value) == f"{path}, {message}"
