"""Bad rows stop the build with a message naming the file and the 1-based row (the line for JSONL and CSV), or,
with skip_bad_rows, are skipped, counted and reported."""

import csv
import json
import logging
import re
from pathlib import Path
from typing import Callable

import pytest

from toolkit.data import (
    chat_dataset,
    instruct_dataset,
    kto_dataset,
    preference_dataset,
    text_completion_dataset,
)
from toolkit.errors import UserError
from toolkit.tokenizers import byte_tokenizer

TOK = byte_tokenizer()
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
GOOD_INSTRUCT = {"input": "hi", "output": "yo"}


def _jsonl_with_bad_line_4(path: Path, good: dict, bad: object) -> str:
    # A blank line 2: line numbers count every line of the file, not just rows.
    path.write_text(f"{json.dumps(good)}\n\n{json.dumps(good)}\n{json.dumps(bad)}\n{json.dumps(good)}\n")
    return str(path)


def _case(name: str, builder: Callable, good: dict, bad: object, reason: str) -> pytest.param:
    return pytest.param(builder, good, bad, reason, id=name)


CHAT = chat_dataset
CASES = [
    _case("missing column", instruct_dataset, GOOD_INSTRUCT, {"input": "hi"},
          "missing column 'output' (the row has: input)"),
    _case("wrong type", instruct_dataset, GOOD_INSTRUCT, {"input": "hi", "output": 42},
          "column 'output' must be a string, got int"),
    _case("null value", instruct_dataset, GOOD_INSTRUCT, {"input": None, "output": "x"},
          "column 'input' must be a string, got null"),
    _case("not an object", instruct_dataset, GOOD_INSTRUCT, ["hi", "yo"],
          "expected an object with named columns, got a list"),
    _case("messages not a list", CHAT, GOOD_CHAT, {"messages": "hi"},
          "column 'messages' must be a list of messages, got str"),
    _case("empty conversation", CHAT, GOOD_CHAT, {"messages": []}, "empty conversation in column 'messages'"),
    _case("unknown role", CHAT, GOOD_CHAT, {"messages": [{"role": "tool", "content": "x"}]},
          "message 1 has unknown role 'tool' (known: system, user, assistant)"),
    _case("unknown ShareGPT role", CHAT, GOOD_CHAT,
          {"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]},
          "message 2 has unknown role 'bot' (known: system, human, user, gpt, assistant)"),
    _case("content not text", CHAT, GOOD_CHAT, {"messages": [{"role": "user", "content": 3}]},
          "message 1's 'content' must be a string, got int"),
    _case("malformed message", CHAT, GOOD_CHAT, {"messages": [{"speaker": "user", "text": "x"}]},
          "message 1 must be an object with 'role' and 'content'"),
    _case("empty text", text_completion_dataset, {"text": "doc"}, {"text": ""}, "column 'text' is empty"),
    _case("missing rejected", preference_dataset, {"prompt": "p", "chosen": "a", "rejected": "b"},
          {"prompt": "p", "chosen": "a"}, "missing column 'rejected'"),
    _case("identical answers", preference_dataset, {"prompt": "p", "chosen": "a", "rejected": "b"},
          {"prompt": "p", "chosen": "a", "rejected": "a"},
          "columns 'chosen' and 'rejected' are the same; a preference pair needs two answers"),
    # An empty answer on either side (a string, or a conversation's last message): judged on nothing but its
    # end-of-turn token, it used to train with no message.
    _case("empty chosen", preference_dataset, {"prompt": "p", "chosen": "a", "rejected": "b"},
          {"prompt": "p", "chosen": "", "rejected": "b"}, "column 'chosen' has an empty answer; a judged answer needs"),
    _case("blank rejected", preference_dataset, {"prompt": "p", "chosen": "a", "rejected": "b"},
          {"prompt": "p", "chosen": "a", "rejected": " \n"}, "column 'rejected' has an empty answer"),
    _case("empty answer in a conversation", preference_dataset, {"prompt": "p", "chosen": "a", "rejected": "b"},
          {"chosen": [{"role": "user", "content": "p"}, {"role": "assistant", "content": ""}],
           "rejected": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "b"}]},
          "column 'chosen' has an empty answer"),
    _case("empty KTO completion", kto_dataset, {"prompt": "p", "completion": "a", "label": True},
          {"prompt": "p", "completion": "", "label": False}, "column 'completion' has an empty answer"),
    _case("empty KTO assistant messages", kto_dataset, {"prompt": "p", "completion": "a", "label": True},
          {"prompt": "p", "completion": [{"role": "assistant", "content": ""}], "label": True},
          "column 'completion' has an empty answer"),
    _case("empty chosen of a KTO pair", kto_dataset, {"prompt": "p", "chosen": "a", "rejected": "b"},
          {"prompt": "p", "chosen": "", "rejected": "b"}, "column 'chosen' has an empty answer"),
    _case("too long", instruct_dataset, GOOD_INSTRUCT, {"input": "x" * 100, "output": "y"},
          "tokens, more than max_seq_len 64 (set truncation: true"),
    # Trained on nothing, it would only cost compute; it used to go in silently, all of its labels ignored.
    _case("no assistant message", CHAT, GOOD_CHAT, {"messages": [{"role": "user", "content": "hi"}]},
          "has no token to train on (a conversation needs an assistant message)"),
]


@pytest.mark.parametrize("builder,good,bad,reason", CASES)
def test_bad_row_names_file_and_line(tmp_path: Path, builder: Callable, good: dict, bad: object, reason: str) -> None:
    source = _jsonl_with_bad_line_4(tmp_path / "data.jsonl", good, bad)
    with pytest.raises(UserError) as info:
        builder(TOK, source=source, max_seq_len=64, truncation=False, cache_dir=None)
    message = str(info.value)
    assert message.startswith(f"{source}, line 4: ")
    assert reason in message
    assert "skip_bad_rows: true" in message  # and how to go on


def test_a_prompt_longer_than_max_seq_len_is_a_bad_row_not_an_untrained_sample(tmp_path: Path) -> None:
    # Truncation keeps the start: with a prompt of 100 bytes and max_seq_len 64, nothing trained would be left.
    bad = {"input": "x" * 100, "output": "y"}
    source = _jsonl_with_bad_line_4(tmp_path / "data.jsonl", GOOD_INSTRUCT, bad)
    with pytest.raises(UserError) as info:
        instruct_dataset(TOK, source=source, max_seq_len=64, cache_dir=None)
    tokens, mask = TOK.tokenize_messages(
        [{"role": "user", "content": bad["input"]}, {"role": "assistant", "content": bad["output"]}]
    )
    first = mask.index(True) + 1
    assert str(info.value).startswith(
        f"{source}, line 4: cut to max_seq_len 64, it keeps no token to train on (the first is token {first} of "
        f"{len(tokens)}); raise max_seq_len"
    )
    # A long answer is cut and kept: it still trains on its first tokens.
    long_answer = _jsonl_with_bad_line_4(tmp_path / "long.jsonl", GOOD_INSTRUCT, {"input": "q", "output": "y" * 100})
    dataset = instruct_dataset(TOK, source=long_answer, max_seq_len=64, cache_dir=None)
    assert len(dataset) == 4 and dataset.report.truncated == 1
    skipped = instruct_dataset(TOK, source=source, max_seq_len=64, skip_bad_rows=True, cache_dir=None)
    assert len(skipped) == 3 and skipped.report.skipped == 1


def test_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD_INSTRUCT) + '\n{"input": "hi", "output": \n')
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}, line 2: not valid JSON"):
        instruct_dataset(TOK, source=str(path), cache_dir=None)


def test_csv_rows_are_named_by_their_starting_line(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerows([["input", "output"], ["multi\nline", "ok"], ["hi", ""], ["only one field"]])
    # Row 2 spans lines 2-3; the empty output on line 4 is fine (an empty response is still a string).
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}, line 5: has 1 fields but the header has 2"):
        instruct_dataset(TOK, source=str(path), cache_dir=None)
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}, line 2: missing column 'question'"):
        instruct_dataset(TOK, source=str(path), column_map={"input": "question"}, cache_dir=None)


def test_json_array_rows_are_numbered_from_one(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps([GOOD_CHAT, {"messages": []}]))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}, row 2: empty conversation"):
        chat_dataset(TOK, source=str(path), cache_dir=None)


def test_parquet_rows_are_numbered_from_one(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([GOOD_INSTRUCT, GOOD_INSTRUCT, {"input": "x", "output": None}]), path,
                   row_group_size=2)
    expected = rf"^{re.escape(str(path))}, row 3: column 'output' must be a string, got null"
    with pytest.raises(UserError, match=expected):
        instruct_dataset(TOK, source=str(path), cache_dir=None)


def test_text_file_document_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe broken")
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path / 'b.txt'))}: not valid UTF-8"):
        text_completion_dataset(TOK, source=str(tmp_path), cache_dir=None)


def test_skip_bad_rows_counts_and_reports(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "data.jsonl"
    bad_role = {"messages": [{"role": "bot", "content": "x"}]}
    rows = [GOOD_CHAT, {"messages": []}, GOOD_CHAT, {"chat": []}, "{oops", GOOD_CHAT, bad_role] + [{"messages": 1}] * 3
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        dataset = chat_dataset(TOK, source=str(path), skip_bad_rows=True, cache_dir=str(tmp_path / "cache"))
    assert len(dataset) == 3
    assert dataset.report.rows == 10 and dataset.report.skipped == 7
    assert dataset.report.skipped_examples[0] == f"{path}, line 2: empty conversation in column 'messages'"
    assert [e.split(":")[0] for e in dataset.report.skipped_examples] == [f"{path}, line {n}" for n in (2, 4, 5, 7, 8)]
    (record,) = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert f"{path}: skipped 7 of 10 rows as bad" in record.getMessage()
    assert f"{path}, line 4: missing column 'messages'" in record.getMessage()

    # Loaded from the cache, the same report is given again: the skipped rows are not forgotten.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        again = chat_dataset(TOK, source=str(path), skip_bad_rows=True, cache_dir=str(tmp_path / "cache"))
    assert again.cache_hit and again.report == dataset.report
    assert any("skipped 7 of 10 rows" in r.getMessage() for r in caplog.records)


def test_all_rows_bad_is_an_error_quoting_the_first(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"messages": []}\n{"messages": 3}\n')
    with pytest.raises(UserError) as info:
        chat_dataset(TOK, source=str(path), skip_bad_rows=True, cache_dir=None)
    assert str(info.value) == (
        f"the dataset has no usable rows: all 2 rows of {path} are bad and were skipped (skip_bad_rows: true); "
        f"the first: {path}, line 1: empty conversation in column 'messages'"
    )


def test_a_preference_prompt_truncation_cuts_before_the_answers_is_a_bad_row(tmp_path: Path) -> None:
    good, bad = {"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p" * 200, "chosen": "a", "rejected": "b"}
    source = _jsonl_with_bad_line_4(tmp_path / "data.jsonl", good, bad)
    with pytest.raises(UserError, match=rf"^{re.escape(str(source))}, line 4: cut to max_seq_len 64, it keeps no token to train on"):
        preference_dataset(TOK, source=source, max_seq_len=64, truncation=True, cache_dir=None)
