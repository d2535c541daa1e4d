"""Prompts for online RL: read from JSONL, JSON and Parquet with the chat template applied and the other columns
kept as fields; bad rows named by file and line or row; the demo's prompts with their answers."""

import json
import logging
import re
from pathlib import Path

import pytest

from toolkit.data import (
    PromptDataset,
    demo_prompt_dataset,
    demo_tasks,
    prompt_dataset,
    rl_collate,
)
from toolkit.errors import UserError
from toolkit.tokenizers import byte_tokenizer

TOK = byte_tokenizer()
ROWS = [
    {"prompt": "What is 2+2?", "answer": "4", "level": 1},
    {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "3*3?"}], "answer": 9},
    {"prompt": [{"from": "human", "value": "sharegpt?"}], "answer": "yes", "extra": {"nested": [1, 2]}},
]


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_prompts_from_jsonl_keep_fields_and_apply_the_template(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", ROWS)
    data = prompt_dataset(TOK, source=source)
    assert isinstance(data, PromptDataset) and len(data) == 3
    first = data[0]
    assert first == {
        "index": 0,
        "prompt_tokens": TOK.prompt_tokens([{"role": "user", "content": "What is 2+2?"}]),
        "prompt": "What is 2+2?",
        "fields": {"answer": "4", "level": 1},
        "where": f"{source}, line 1",
    }
    second = data[1]
    assert second["prompt"] == "3*3?" and second["fields"] == {"answer": 9}
    assert second["prompt_tokens"] == TOK.prompt_tokens(ROWS[1]["prompt"])  # the whole conversation, then the header
    assert TOK.decode(second["prompt_tokens"]).count("yo") == 1
    assert data[2]["prompt"] == "sharegpt?" and data[2]["fields"] == {"answer": "yes", "extra": {"nested": [1, 2]}}
    assert [item["index"] for item in data] == [0, 1, 2]
    assert data.longest_prompt() == (len(second["prompt_tokens"]), f"{source}, line 2")
    batch = [data[0], data[2]]
    assert rl_collate(batch) == batch


def test_prompts_from_json_and_a_custom_column_with_a_system_prompt(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"question": "q1", "answer": "a1"}, {"question": "q2", "answer": "a2"}]))
    data = prompt_dataset(TOK, source=str(path), prompt_column="question", system_prompt="Think.")
    assert [item["prompt"] for item in data] == ["q1", "q2"]
    assert data[1]["fields"] == {"answer": "a2"} and data[1]["where"] == f"{path}, row 2"
    system = [{"role": "system", "content": "Think."}, {"role": "user", "content": "q2"}]
    assert data[1]["prompt_tokens"] == TOK.prompt_tokens(system)
    # A conversation with its own system message keeps it.
    own = prompt_dataset(TOK, source=_jsonl(tmp_path / "s.jsonl", [ROWS[1]]), system_prompt="Think.")
    assert own[0]["prompt_tokens"] == TOK.prompt_tokens(ROWS[1]["prompt"])


def test_prompts_from_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    data = prompt_dataset(TOK, source=str(path))
    assert [(item["prompt"], item["fields"], item["where"]) for item in data] == [
        ("a", {"answer": "1"}, f"{path}, row 1"), ("b", {"answer": "2"}, f"{path}, row 2"),
    ]


@pytest.mark.parametrize("bad,reason", [
    ({"question": "x"}, "missing column 'prompt' (the row has: question)"),
    ({"prompt": 7}, "column 'prompt' must be a string or a list of messages, got int"),
    ({"prompt": None}, "column 'prompt' must be a string or a list of messages, got null"),
    ({"prompt": ""}, "column 'prompt' has an empty prompt"),
    ({"prompt": "  \n"}, "column 'prompt' has an empty prompt"),
    ({"prompt": []}, "empty conversation in column 'prompt'"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
     "column 'prompt' must end with a user message (the prompt to answer); its last message is the assistant's"),
    ({"prompt": [{"role": "user", "content": ""}]}, "column 'prompt' has an empty prompt"),
    ({"prompt": [{"role": "robot", "content": "q"}]}, "message 1 has unknown role 'robot' (known: system, user, assistant)"),
    (["not", "an", "object"], "expected an object with named columns, got a list"),
])
def test_a_bad_row_is_named_by_file_and_line(tmp_path: Path, bad: object, reason: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(f'{json.dumps(ROWS[0])}\n\n{json.dumps(bad)}\n{json.dumps(ROWS[0])}\n')
    with pytest.raises(UserError) as error:
        prompt_dataset(TOK, source=str(path))
    assert str(error.value) == f"{path}, line 3: {reason} (fix the row, or set skip_bad_rows: true to skip bad rows)"


def test_an_unreadable_line_and_skip_bad_rows(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(f'{json.dumps(ROWS[0])}\n{{"prompt": \n{json.dumps({"prompt": 3})}\n{json.dumps(ROWS[2])}\n')
    with pytest.raises(UserError, match=re.escape(f"{path}, line 2: not valid JSON")):
        prompt_dataset(TOK, source=str(path))
    with caplog.at_level(logging.WARNING, logger="toolkit.data"):
        data = prompt_dataset(TOK, source=str(path), skip_bad_rows=True)
    assert [item["where"] for item in data] == [f"{path}, line 1", f"{path}, line 4"]
    assert [item["index"] for item in data] == [0, 1] and data.skipped == 2
    assert "skipped 2 of 4 rows as bad" in caplog.text and f"{path}, line 3: column 'prompt'" in caplog.text
    (tmp_path / "bad.jsonl").write_text('{"prompt": 1}\n')
    with pytest.raises(UserError, match="the prompts have no usable rows: all 1 rows"):
        prompt_dataset(TOK, source=str(tmp_path / "bad.jsonl"), skip_bad_rows=True)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(UserError, match=re.escape(f"the prompts have no rows: {tmp_path / 'empty.jsonl'} has only")):
        prompt_dataset(TOK, source=str(tmp_path / "empty.jsonl"))


def test_max_prompt_tokens(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", [{"prompt": "ab"}, {"prompt": "a much longer prompt"}])
    length = len(TOK.prompt_tokens([{"role": "user", "content": "a much longer prompt"}]))
    assert len(prompt_dataset(TOK, source=source, max_prompt_tokens=length)) == 2
    with pytest.raises(UserError, match=re.escape(
        f"{source}, line 2: the prompt is {length} tokens, more than max_prompt_tokens {length - 1}"
    )):
        prompt_dataset(TOK, source=source, max_prompt_tokens=length - 1)
    for bad in (0, -3, 1.5, True, "10"):
        with pytest.raises(UserError, match=f"max_prompt_tokens must be a positive integer; got {re.escape(repr(bad))}"):
            prompt_dataset(TOK, source=source, max_prompt_tokens=bad)


def test_bad_options(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(UserError, match="system_prompt must be a string, got int 3"):
        prompt_dataset(TOK, source=source, system_prompt=3)
    with pytest.raises(UserError, match="prompt_column must be a column name, got ''"):
        prompt_dataset(TOK, source=source, prompt_column="")
    with pytest.raises(UserError, match="does not exist"):
        prompt_dataset(TOK, source=str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="dataset split='test' selects from a hub dataset"):
        prompt_dataset(TOK, source=source, split="test")


def test_demo_prompts_are_deterministic_and_carry_answers() -> None:
    data = demo_prompt_dataset(TOK, num_samples=8, seed=3)
    again = demo_prompt_dataset(TOK, num_samples=8, seed=3)
    assert [data[i] for i in range(8)] == [again[i] for i in range(8)]
    tasks = demo_tasks(num_samples=8, seed=3)
    for i, (item, task) in enumerate(zip(data, tasks)):
        assert item["prompt"] == task["prompt"] and item["fields"] == {"task": task["task"], "answer": task["answer"]}
        assert item["prompt_tokens"] == TOK.prompt_tokens([{"role": "user", "content": task["prompt"]}])
        assert item["index"] == i and item["where"] == f"demo train row {i + 1}"
    heldout = demo_prompt_dataset(TOK, split="heldout", num_samples=8, seed=3, tasks=["reverse"])
    assert {item["fields"]["task"] for item in heldout} == {"reverse"}
    assert all(item["fields"]["answer"] == item["prompt"].split(": ")[1][::-1] for item in heldout)
    assert heldout[0]["where"] == "demo heldout row 1"
    assert demo_prompt_dataset(TOK, num_samples=8, seed=4)[0] != data[0]
    with pytest.raises(UserError, match="demo split must be one of"):
        demo_prompt_dataset(TOK, split="test")


def test_a_real_model_on_the_demo_prompts_is_warned_about() -> None:
    from omegaconf import OmegaConf

    from toolkit.data import demo_data_warning

    cfg = OmegaConf.create({
        "model": {"_component_": "toolkit.models.llama3_1_8b"},
        "tokenizer": {"_component_": "toolkit.tokenizers.auto_tokenizer"},
        "dataset": {"_component_": "toolkit.data.demo_prompt_dataset"},
    })
    warning = demo_data_warning(cfg)
    assert warning is not None and warning.startswith("dataset: toolkit.data.demo_prompt_dataset is the demo's")
    assert "dataset: {_component_: toolkit.data.prompt_dataset, source: path/to/prompts.jsonl}" in warning
    cfg.tokenizer._component_ = "toolkit.tokenizers.byte_tokenizer"  # the demo's own tiny model
    assert demo_data_warning(cfg) is None
