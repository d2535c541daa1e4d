"""A tokenizer over UTF-8 bytes plus a handful of chat special tokens. It needs no files, so tiny test models and
the demo recipe run anywhere.

Ids 0..255 are the bytes themselves; the special tokens follow from 256. A conversation is laid out as::

    <|begin_of_text|>
    <|start_header|>user<|end_header|>Hi<|eot|>
    <|start_header|>assistant<|end_header|>Hello<|eot|>
    <|end_of_text|>

(shown on four lines; no newlines are inserted). Text is always encoded as plain bytes, so a string such as ``"<|eot|>"`` inside a message stays text and can
never smuggle a special token into the sequence.
"""

from typing import Iterable

from toolkit.errors import UserError
from toolkit.tokenizers.base import TRAIN_ON

ROLES: tuple[str, ...] = ("system", "user", "assistant")

# Order fixes the ids: the i-th special token gets id 256 + i.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|start_header|>",
    "<|end_header|>",
    "<|eot|>",
)
_NUM_BYTES = 256


class ByteTokenizer:
    """UTF-8 byte tokenizer with a minimal chat format.

    Args:
        max_seq_len: if set, :meth:`encode` and :meth:`tokenize_messages` keep only the first ``max_seq_len``
            tokens.
    """

    def __init__(self, max_seq_len: int | None = None) -> None:
        if max_seq_len is not None and max_seq_len < 1:
            raise UserError(f"tokenizer max_seq_len must be a positive integer or null, got {max_seq_len}")
        self.max_seq_len = max_seq_len
        self.special_tokens: dict[str, int] = {tok: _NUM_BYTES + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._id_to_special = {i: tok for tok, i in self.special_tokens.items()}
        self.start_header_id = self.special_tokens["<|start_header|>"]
        self.end_header_id = self.special_tokens["<|end_header|>"]
        self.eot_id = self.special_tokens["<|eot|>"]

    @property
    def bos_id(self) -> int:
        return self.special_tokens["<|begin_of_text|>"]

    @property
    def eos_id(self) -> int:
        return self.special_tokens["<|end_of_text|>"]

    @property
    def pad_id(self) -> int:
        return self.special_tokens["<|pad|>"]

    @property
    def vocab_size(self) -> int:
        """Number of ids this tokenizer produces (a model's embedding table may be larger)."""
        return _NUM_BYTES + len(self.special_tokens)

    @property
    def stop_tokens(self) -> list[int]:
        """Ids that end generation: the end of a turn and the end of the text."""
        return [self.eot_id, self.eos_id]

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """Encodes ``text`` as its UTF-8 bytes, optionally framed by bos/eos, truncated to ``max_seq_len``."""
        ids = ([self.bos_id] if add_bos else []) + list(text.encode("utf-8"))
        if add_eos:
            ids.append(self.eos_id)
        return self._truncate(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Turns ids back into text; never raises.

        Invalid UTF-8 (for example a sequence cut inside a multi-byte character) becomes U+FFFD, and so does an
        id outside the vocabulary, which a model with a padded embedding table can sample.

        Args:
            ids: token ids (a list or a 1-D tensor).
            skip_special_tokens: drop special tokens instead of writing them as ``<|...|>``.
        """
        pieces: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < _NUM_BYTES:
                run.append(i)
                continue
            # Bytes are decoded run by run so that a special token between them is never glued into a character.
            pieces.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if i in self._id_to_special:
                if not skip_special_tokens:
                    pieces.append(self._id_to_special[i])
            else:
                pieces.append("\ufffd")
        pieces.append(run.decode("utf-8", errors="replace"))
        return "".join(pieces)

    def tokenize_messages(
        self, messages: list[dict], *, add_eos: bool = True, train_on: str = "assistant"
    ) -> tuple[list[int], list[bool]]:
        """Lays out a conversation and says which tokens are trained on.

        Args:
            messages: dicts with ``role`` (system, user or assistant) and ``content`` (str).
            add_eos: end the sequence with eos.
            train_on: ``"assistant"``: the content and ``<|eot|>`` of every assistant message;
                ``"last_turn"``: only those of the last assistant message; ``"all"``: every token but bos.
                Headers (``<|start_header|>role<|end_header|>``) are context, never targets, except under
                ``"all"``. The final eos is trained when the message before it is.

        Returns:
            ``(tokens, mask)`` of equal length, ``mask[i]`` True where token i is a training target; both
            truncated to ``max_seq_len``.

        Raises:
            UserError: on an unknown ``train_on``, a message without ``role``/``content``, or an unknown role.
        """
        tokens, mask = self._layout(messages, add_eos=add_eos, train_on=train_on)
        return self._truncate(tokens), self._truncate(mask)

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens that prompt the model for the next assistant turn: bos, the messages, an assistant header.

        Not truncated: cutting the end would remove the header the model needs to start answering.
        """
        tokens, _ = self._layout(messages, add_eos=False, train_on="assistant")
        return tokens + self._header("assistant")

    def _layout(self, messages: list[dict], *, add_eos: bool, train_on: str) -> tuple[list[int], list[bool]]:
        if train_on not in TRAIN_ON:
            raise UserError(f"train_on must be one of {', '.join(TRAIN_ON)}; got {train_on!r}")
        for message in messages:
            self._check_message(message)
        last_assistant = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)

        tokens = [self.bos_id]
        mask = [False]
        # With no messages there is nothing before eos to inherit from.
        trained = train_on == "all"
        for i, message in enumerate(messages):
            header = self._header(message["role"])
            body = list(message["content"].encode("utf-8")) + [self.eot_id]
            if train_on == "all":
                trained = True
            elif train_on == "assistant":
                trained = message["role"] == "assistant"
            else:
                trained = i == last_assistant
            tokens += header + body
            mask += [train_on == "all"] * len(header) + [trained] * len(body)
        if add_eos:
            tokens.append(self.eos_id)
            mask.append(trained)
        return tokens, mask

    def _header(self, role: str) -> list[int]:
        return [self.start_header_id] + list(role.encode("utf-8")) + [self.end_header_id]

    def _truncate(self, seq: list) -> list:
        return seq if self.max_seq_len is None else seq[: self.max_seq_len]

    @staticmethod
    def _check_message(message: dict) -> None:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise UserError(f"each message must be a dict with 'role' and 'content'; got {message!r}")
        if message["role"] not in ROLES:
            raise UserError(f"message role must be one of {', '.join(ROLES)}; got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise UserError(f"message content must be a string; got {type(message['content']).__name__}")


def byte_tokenizer(max_seq_len: int | None = None) -> ByteTokenizer:
    """Builds a :class:`ByteTokenizer` (configs: ``_component_: toolkit.tokenizers.byte_tokenizer``).

    Args:
        max_seq_len: keep at most this many tokens per sequence; ``None`` keeps all.
    """
    return ByteTokenizer(max_seq_len=max_seq_len)
