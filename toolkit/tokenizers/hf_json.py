"""Vocabularies from a Hugging Face ``tokenizer.json`` (byte-level BPE for Qwen and Phi-4), on the ``tokenizers``
library."""

from pathlib import Path

from tokenizers import Tokenizer

from toolkit.errors import UserError
from toolkit.tokenizers.chat_templates import (
    ChatFormat,
    ChatMLFormat,
    Phi4ChatFormat,
    Phi4MiniChatFormat,
    Qwen3ChatFormat,
)
from toolkit.tokenizers.model_tokenizer import ModelTokenizer

# What Qwen2.5's chat template says when a conversation brings no system message (Qwen3's says nothing).
QWEN2_5_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


class TokenizerJSONEngine:
    """Text to ids with the ``tokenizers`` library; the file's added special tokens are the special tokens.

    Args:
        path: the ``tokenizer.json`` file.

    Raises:
        UserError: the file is missing or unreadable.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"{path}: tokenizer file not found")
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the library raises plain Exception for every parse problem
            raise UserError(f"{path}: not a tokenizer.json ({e})") from None
        # Special-token strings inside text stay text (the chat format inserts the real ones by id). Added tokens
        # that are not special (Qwen3's <think> and </think>) are matched in text, as the reference does.
        self._tokenizer.encode_special_tokens = True
        self._special_ids = {
            i: added.content for i, added in self._tokenizer.get_added_tokens_decoder().items() if added.special
        }

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> dict[int, str]:
        return self._special_ids

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


def _endoftext_tokenizer(
    path: str, chat_format: ChatFormat, *, end_of_turn: str, max_seq_len: int | None
) -> ModelTokenizer:
    # The byte-level BPE families here (Qwen, Phi-4): no BOS, <|endoftext|> as eos and padding, and generation stops
    # at the token that ends a turn or at <|endoftext|>.
    return ModelTokenizer(
        engine=TokenizerJSONEngine(path), chat_format=chat_format, bos_token=None, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>", stop_tokens=[end_of_turn, "<|endoftext|>"], max_seq_len=max_seq_len,
    )


def qwen2_5_tokenizer(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """Qwen2.5's tokenizer (ChatML, with Qwen2.5's default system prompt) from its ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json``.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    chat_format = ChatMLFormat(default_system_prompt=QWEN2_5_DEFAULT_SYSTEM)
    return _endoftext_tokenizer(path, chat_format, end_of_turn="<|im_end|>", max_seq_len=max_seq_len)


def qwen3_tokenizer(path: str, max_seq_len: int | None = None, *, enable_thinking: bool = True) -> ModelTokenizer:
    """Qwen3's tokenizer (ChatML with ``<think>`` reasoning, no default system prompt) from its ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json``.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
        enable_thinking: as Qwen3's template: ``False`` makes generation prompts end with an empty think block
            (see :class:`~toolkit.tokenizers.chat_templates.Qwen3ChatFormat`).
    """
    chat_format = Qwen3ChatFormat(enable_thinking=enable_thinking)
    return _endoftext_tokenizer(path, chat_format, end_of_turn="<|im_end|>", max_seq_len=max_seq_len)


def phi4_tokenizer(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """Phi-4's tokenizer (GPT-style byte-level BPE; :class:`~toolkit.tokenizers.chat_templates.Phi4ChatFormat`)
    from its ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json``.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    return _endoftext_tokenizer(path, Phi4ChatFormat(), end_of_turn="<|im_end|>", max_seq_len=max_seq_len)


def phi4_mini_tokenizer(path: str, max_seq_len: int | None = None) -> ModelTokenizer:
    """Phi-4-mini's tokenizer (byte-level BPE on o200k's vocabulary;
    :class:`~toolkit.tokenizers.chat_templates.Phi4MiniChatFormat`) from its ``tokenizer.json``.

    Args:
        path: the ``tokenizer.json``.
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    return _endoftext_tokenizer(path, Phi4MiniChatFormat(), end_of_turn="<|end|>", max_seq_len=max_seq_len)
