"""Shared text for the tokenizer tests: a corpus to train tiny vocabularies on and one to compare encodings on."""

from pathlib import Path

import pytest

from toolkit.config import instantiate, load_config
from toolkit.paths import configs_dir

# Varied on purpose: accents, CJK, emoji (with a skin-tone modifier), whitespace runs and tabs, leading and
# trailing spaces, digit runs, code, and special-token strings that must stay text.
SAMPLES: list[str] = [
    "Hello world! How are you today?",
    "naïve café, déjà vu — «quotes» and ‘single’ ones",
    "日本語のテキストと中文文本",
    "emoji: 👍🏽 🎉🎉 ❤️",
    "a   b\t\tc\n\n\nd    \n  e",
    "   leading spaces",
    "trailing spaces   ",
    "numbers 1234567890 and 3.14159, -42",
    "def f(x):\n    return x ** 2  # square\n",
    "<|eot_id|> <|im_start|> <start_of_turn> [INST] <s></s> are only text here",
    "I'm sure they'll say it's fine; we've done what you'd do",
    "",
]


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    """A few kilobytes of text covering the characters of SAMPLES, repeated with variations."""
    base = SAMPLES[:-1] + [
        "The quick brown fox jumps over the lazy dog.",
        "Fine-tuning language models needs data, compute and patience.",
        "user assistant system model INST SYS",
        "Question: what is two plus two? Answer: four.",
    ]
    return [f"{line} {i}" if i % 3 else line for i in range(12) for line in base]


@pytest.fixture
def samples() -> list[str]:
    return SAMPLES


CONVERSATIONS: list[list[dict]] = [
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour 🎨"},
        {"role": "assistant", "content": " Blue. "},
        {"role": "user", "content": "Another one,  please\n"},
        {"role": "assistant", "content": "Red"},
    ],
]


@pytest.fixture
def conversations() -> list[list[dict]]:
    return CONVERSATIONS


def _check_masks(tokenizer, messages: list[dict], bodies: list[str]) -> None:
    tokens, mask = tokenizer.tokenize_messages(messages, add_eos=False, train_on="assistant")
    assert len(tokens) == len(mask)
    trained = tokenizer.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False)
    assert trained.replace(" ", "") == "".join(bodies).replace(" ", "")
    last = tokenizer.tokenize_messages(messages, add_eos=False, train_on="last_turn")
    assert last[0] == tokens
    last_trained = tokenizer.decode([t for t, m in zip(*last) if m], skip_special_tokens=False)
    assert last_trained.replace(" ", "") == bodies[-1].replace(" ", "")
    everything = tokenizer.tokenize_messages(messages, add_eos=True, train_on="all")
    assert everything[0][-1] == tokenizer.eos_id and everything[1] == [False] + [True] * (len(everything[0]) - 1)
    # Truncation cuts tokens and mask alike.
    tokenizer.max_seq_len = 5
    assert tokenizer.tokenize_messages(messages, train_on="assistant") == (tokens[:5], mask[:5])
    assert len(tokenizer.encode("a long enough text to be cut")) == 5
    tokenizer.max_seq_len = None


@pytest.fixture
def check_masks():
    """``check_masks(tokenizer, messages, bodies)``: the trained tokens of ``train_on=assistant`` decode to
    ``bodies`` (each assistant message's content and closing token; spaces ignored, as sentencepiece moves them),
    ``last_turn`` to the last body, ``all`` trains everything but the first token, and truncation applies."""
    return _check_masks


def _config_chat_formats(pattern: str, folder: Path) -> list[tuple[Path, object]]:
    configs = sorted(configs_dir().glob(pattern))
    assert configs, f"no config matches {pattern}"
    formats = []
    for path in configs:
        cfg = load_config(path)
        cfg.checkpointer.checkpoint_dir = str(folder)
        formats.append((path, instantiate(cfg.tokenizer).chat_format))
    return formats


@pytest.fixture
def config_chat_formats():
    """``config_chat_formats(pattern, folder)``: ``(config path, chat format)`` of every shipped config matching
    ``pattern`` (e.g. ``*/llama3_*.yaml``), its tokenizer built from the model folder ``folder``."""
    return _config_chat_formats
