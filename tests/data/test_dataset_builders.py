"""The builders: what each row becomes, label masking, truncation, preference pairs, KTO's unpaired answers (and
their KL sequences) and their collates."""

import json
from pathlib import Path

import pytest
import torch

from toolkit.data import (
    CROSS_ENTROPY_IGNORE_INDEX,
    chat_dataset,
    instruct_dataset,
    kto_collate,
    kto_dataset,
    preference_collate,
    preference_dataset,
    shifted_labels,
    text_completion_dataset,
)
from toolkit.errors import UserError
from toolkit.tokenizers import byte_tokenizer

TOK = byte_tokenizer()


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _targets(sample: dict) -> str:
    """The text of the trained tokens (the labels that are not ignored)."""
    return TOK.decode([label for label in sample["labels"] if label != CROSS_ENTROPY_IGNORE_INDEX])


def test_instruct_column_map_template_and_system(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [{"instruction": "Add", "question": "2+2", "answer": "4", "sys": "S"}])
    dataset = instruct_dataset(
        TOK, source=source, column_map={"input": "question", "output": "answer"},
        prompt_template="{instruction}: {input}", system_prompt="Be brief.", cache_dir=None,
    )
    sample = dataset[0]
    expected, mask = TOK.tokenize_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add: 2+2"},
        {"role": "assistant", "content": "4"},
    ])
    assert sample == {"tokens": expected, "labels": shifted_labels(expected, mask)}
    assert _targets(sample) == "4"  # the response, its end of turn and eos (special tokens decode to nothing)
    # A mapped system column wins over the fixed prompt.
    per_row = instruct_dataset(
        TOK, source=source, column_map={"input": "question", "output": "answer", "system": "sys"}, cache_dir=None,
    )
    assert TOK.decode(per_row[0]["tokens"]) == "systemSuser2+2assistant4"


def test_instruct_rejects_bad_options(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [{"input": "a", "output": "b"}])
    with pytest.raises(UserError, match="column_map key.*'inptu'"):
        instruct_dataset(TOK, source=source, column_map={"inptu": "x"}, cache_dir=None)
    with pytest.raises(UserError, match="prompt_template fields must be column names"):
        instruct_dataset(TOK, source=source, prompt_template="{0}", cache_dir=None)
    with pytest.raises(UserError, match="names no column"):
        instruct_dataset(TOK, source=source, prompt_template="fixed", cache_dir=None)
    with pytest.raises(UserError, match="train_on must be one of"):
        instruct_dataset(TOK, source=source, train_on="everything", cache_dir=None)


MULTI_TURN = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "a2"},
]


@pytest.mark.parametrize(
    "train_on,targets",
    [("assistant", "a1a2"), ("last_turn", "a2"), ("all", "userq1assistanta1userq2assistanta2")],
)
def test_chat_label_masking(tmp_path: Path, train_on: str, targets: str) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [{"messages": MULTI_TURN}])
    sample = chat_dataset(TOK, source=source, train_on=train_on, cache_dir=None)[0]
    assert _targets(sample) == targets
    assert sample["labels"][-1] == CROSS_ENTROPY_IGNORE_INDEX and len(sample["labels"]) == len(sample["tokens"])


def test_openai_and_sharegpt_are_the_same_conversation(tmp_path: Path) -> None:
    sharegpt = [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]} for m in MULTI_TURN]
    openai_parts = [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in MULTI_TURN]
    source = _jsonl(tmp_path / "d.jsonl", [
        {"messages": MULTI_TURN}, {"conversations": sharegpt}, {"messages": openai_parts}, {"dialog": MULTI_TURN},
    ])
    dataset = chat_dataset(TOK, source=source, system_prompt="S", skip_bad_rows=True, cache_dir=None)
    assert len(dataset) == 3 and dataset[0] == dataset[1] == dataset[2]
    assert TOK.decode(dataset[0]["tokens"]).startswith("systemSuserq1")
    renamed = chat_dataset(TOK, source=source, column_map={"messages": "dialog"}, skip_bad_rows=True, cache_dir=None)
    assert len(renamed) == 1 and TOK.decode(renamed[0]["tokens"]).startswith("userq1")


def test_system_prompt_does_not_replace_an_existing_one(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "system", "content": "mine"}] + MULTI_TURN}])
    sample = chat_dataset(TOK, source=source, system_prompt="default", cache_dir=None)[0]
    assert TOK.decode(sample["tokens"]).startswith("systemmineuserq1")


def test_text_completion_trains_on_every_token(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("hello world\nsecond\n")
    dataset = text_completion_dataset(TOK, source=str(path), cache_dir=None)
    assert len(dataset) == 2
    tokens = TOK.encode("hello world")
    assert dataset[0] == {"tokens": tokens, "labels": tokens[1:] + [CROSS_ENTROPY_IGNORE_INDEX]}


def test_truncation_uses_the_datasets_max_seq_len(tmp_path: Path) -> None:
    path = tmp_path / "d.txt"
    path.write_text("x" * 50 + "\nshort\n")
    # The tokenizer's own limit is the default; the dataset measures full lengths itself.
    dataset = text_completion_dataset(byte_tokenizer(max_seq_len=16), source=str(path), cache_dir=None)
    assert [len(dataset[i]["tokens"]) for i in range(2)] == [16, 7]
    assert dataset.report.truncated == 1
    longer = text_completion_dataset(byte_tokenizer(max_seq_len=16), source=str(path), max_seq_len=40, cache_dir=None)
    assert len(longer[0]["tokens"]) == 40
    unlimited = text_completion_dataset(byte_tokenizer(), source=str(path), cache_dir=None)
    assert len(unlimited[0]["tokens"]) == 52


def test_preference_pairs_and_collate(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "2+2?", "chosen": "4", "rejected": "five"},
        {
            "prompt": "ignored",
            "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
            "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "go away"}],
        },
    ])
    dataset = preference_dataset(TOK, source=source, cache_dir=None)
    assert len(dataset) == 2
    first = dataset[0]
    assert TOK.decode(first["chosen_tokens"]) == "user2+2?assistant4"
    assert TOK.decode(first["rejected_tokens"]) == "user2+2?assistantfive"
    assert _targets({"labels": first["rejected_labels"]}) == "five"
    batch = preference_collate([dataset[0], dataset[1]], pad_id=TOK.pad_id)
    assert batch["tokens"].shape[0] == 4
    assert batch["tokens"][0, : len(first["chosen_tokens"])].tolist() == first["chosen_tokens"]
    assert batch["tokens"][2, : len(first["rejected_tokens"])].tolist() == first["rejected_tokens"]
    assert (batch["labels"][1] != CROSS_ENTROPY_IGNORE_INDEX).sum() == len("hello") + 2  # + end of turn, eos
    assert batch["labels"].dtype == torch.long


def test_reasoning_content_reaches_the_chat_format() -> None:
    # Qwen3's template puts an assistant turn's reasoning_content in <think>; the data must not drop it.
    from toolkit.data.formats import BadRowError, normalize_messages

    messages = normalize_messages(
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "why"}],
        name="messages",
    )
    assert messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "why"} and messages[0].keys() == {
        "role", "content"}
    with pytest.raises(BadRowError, match="reasoning_content"):
        normalize_messages([{"role": "assistant", "content": "a", "reasoning_content": 3}], name="messages")


def test_preference_pairs_score_only_the_last_answer_by_default(tmp_path: Path) -> None:
    # A multi-turn pair (UltraFeedback/HH-RLHF as message lists): the earlier turns are context, as the preference
    # losses define the log-probability of the answer the pair compares; train_on=assistant scores them too.
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}, {"role": "user", "content": "q"}]
    source = _jsonl(tmp_path / "d.jsonl", [{
        "chosen": [*turns, {"role": "assistant", "content": "good"}],
        "rejected": [*turns, {"role": "assistant", "content": "bad"}],
    }])
    pair = preference_dataset(TOK, source=source, cache_dir=None)[0]
    assert _targets({"labels": pair["chosen_labels"]}).startswith("good")
    assert "hey" not in _targets({"labels": pair["rejected_labels"]})
    every = preference_dataset(TOK, source=source, cache_dir=None, train_on="assistant")[0]
    assert _targets({"labels": every["chosen_labels"]}).startswith("hey")


def test_kto_rows_unpaired_or_from_pairs_and_their_kl_sequences(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "2+2?", "completion": "4", "label": True},
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
         "label": 0},  # TRL's conversational layout; 0/1 as booleans
        {"prompt": "sky?", "chosen": "blue", "rejected": "green"},  # a pair: two rows, chosen desirable
    ])
    cache = tmp_path / "cache"
    dataset = kto_dataset(TOK, source=source, cache_dir=str(cache))
    assert len(dataset) == 4 and dataset.num_desirable == 2
    answers = [(TOK.decode(s["completion_tokens"]), _targets({"labels": s["completion_labels"]}), s["desirable"])
               for s in (dataset[i] for i in range(4))]
    assert [(text, good) for text, _, good in answers] == [
        ("user2+2?assistant4", True), ("userhiassistantyo", False), ("usersky?assistantblue", True),
        ("usersky?assistantgreen", False)]
    assert [target for _, target, _ in answers] == ["4", "yo", "blue", "green"]  # (and end of turn, eos)
    # Each prompt is scored with another row's answer: a cycle through all rows, drawn from kl_seed.
    partners = dataset.partner.tolist()
    assert sorted(partners) == [0, 1, 2, 3] and all(p != i for i, p in enumerate(partners))
    for i, j in enumerate(partners):
        own, other = dataset[i], dataset[j]
        kl_text = TOK.decode(dataset[i]["kl_tokens"])
        prompt = TOK.decode(own["completion_tokens"]).rsplit("assistant", 1)[0]
        assert kl_text == prompt + "assistant" + answers[j][0].rsplit("assistant", 1)[1]
        assert _targets({"labels": own["kl_labels"]}) == _targets({"labels": other["completion_labels"]})
        assert len(own["kl_labels"]) == len(own["kl_tokens"])
    # From the cache: the labels (the store's tags) come back with the tokens.
    again = kto_dataset(TOK, source=source, cache_dir=str(cache))
    assert again.cache_hit and again.desirable.tolist() == dataset.desirable.tolist()
    batch = kto_collate([dataset[0], dataset[1]], pad_id=TOK.pad_id)
    assert batch["tokens"].shape[0] == 4 and batch["desirable"].tolist() == [True, False]
    assert batch["tokens"][2, : len(dataset[0]["kl_tokens"])].tolist() == dataset[0]["kl_tokens"]


def test_kto_kl_sequences_are_cut_to_max_seq_len_and_labels_read_from_csv(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("prompt,completion,label\nshort,a much longer answer than the other,TRUE\n"
                    "a rather long prompt here,b,false\n")
    dataset = kto_dataset(TOK, source=str(path), cache_dir=None, max_seq_len=48)
    assert dataset.desirable.tolist() == [True, False]
    long_prompt = dataset[1]  # its prompt with the other's long answer: cut to 48, still training on some of it
    assert len(long_prompt["kl_tokens"]) == 48 and long_prompt["kl_labels"][-1] == CROSS_ENTROPY_IGNORE_INDEX
    assert _targets({"labels": long_prompt["kl_labels"]}) == "a mu"


def test_kto_needs_two_rows(tmp_path: Path) -> None:
    source = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "completion": "a", "label": True}])
    with pytest.raises(UserError, match="kto needs at least two rows"):
        kto_dataset(TOK, source=source, cache_dir=None)
