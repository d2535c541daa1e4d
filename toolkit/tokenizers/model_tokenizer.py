"""A model's tokenizer: a vocabulary engine (tiktoken, sentencepiece or tokenizer.json) composed with the
model's chat format and special tokens."""

from collections.abc import Iterable
from typing import Protocol

from toolkit.errors import UserError
from toolkit.tokenizers.chat_templates import ChatFormat, layout


class TextEngine(Protocol):
    """What :class:`ModelTokenizer` needs from a vocabulary: text to ids without special tokens, and back."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_ids(self) -> dict[int, str]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


class ModelTokenizer:
    """Implements :class:`~toolkit.tokenizers.ChatTokenizer` for a real model's vocabulary.

    Message text is always encoded as text: a special token's string inside a message stays text, so data cannot
    smuggle control tokens into a sequence (sentencepiece's user-defined pieces, e.g. Gemma's
    ``<start_of_turn>``, are the exception: the engine itself matches them).

    Args:
        engine: the vocabulary.
        chat_format: the model's chat format.
        bos_token: prepended by ``encode(add_bos=True)``; ``None`` for vocabularies without one (Qwen).
        eos_token: appended by ``encode(add_eos=True)`` and ``tokenize_messages(add_eos=True)``.
        pad_token: what collation pads with (never trained on).
        stop_tokens: tokens that end generation.
        max_seq_len: if set, ``encode`` and ``tokenize_messages`` keep only the first ``max_seq_len`` tokens.

    Raises:
        UserError: a named special token is not in the vocabulary.
    """

    def __init__(
        self,
        *,
        engine: TextEngine,
        chat_format: ChatFormat,
        bos_token: str | None,
        eos_token: str,
        pad_token: str,
        stop_tokens: list[str],
        max_seq_len: int | None = None,
    ) -> None:
        if max_seq_len is not None and max_seq_len < 1:
            raise UserError(f"tokenizer max_seq_len must be a positive integer or null, got {max_seq_len}")
        self.engine = engine
        self.chat_format = chat_format
        self.max_seq_len = max_seq_len
        self._bos_id = self.special_id(bos_token) if bos_token is not None else None
        self._eos_id = self.special_id(eos_token)
        self._pad_id = self.special_id(pad_token)
        self._stop_ids = [self.special_id(token) for token in stop_tokens]

    def special_id(self, token: str) -> int:
        """The id of a special token.

        Raises:
            UserError: the vocabulary has no such token.
        """
        token_id = self.engine.token_to_id(token)
        if token_id is None:
            raise UserError(f"tokenizer: the vocabulary has no special token {token!r}")
        return token_id

    @property
    def bos_id(self) -> int:
        """The begin-of-sequence id; vocabularies without one (Qwen) answer with eos, which they use instead."""
        return self._bos_id if self._bos_id is not None else self._eos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def stop_tokens(self) -> list[int]:
        return list(self._stop_ids)

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = True) -> list[int]:
        """``text`` as ids, optionally framed by bos (when the vocabulary has one) and eos, truncated."""
        ids = [self._bos_id] if add_bos and self._bos_id is not None else []
        ids += self.engine.encode(text)
        if add_eos:
            ids.append(self._eos_id)
        return self._truncate(ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Ids back to text; an id outside the vocabulary becomes U+FFFD rather than an error."""
        specials = self.engine.special_ids
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            i = int(i)
            if 0 <= i < self.vocab_size and i not in specials:
                run.append(i)
                continue
            # Runs are decoded separately so that a special token is never glued into a character.
            if run:
                pieces.append(self.engine.decode(run))
                run = []
            if i in specials:
                if not skip_special_tokens:
                    pieces.append(specials[i])
            else:
                pieces.append("\ufffd")
        if run:
            pieces.append(self.engine.decode(run))
        return "".join(pieces)

    def tokenize_messages(
        self, messages: list[dict], *, add_eos: bool = True, train_on: str = "assistant"
    ) -> tuple[list[int], list[bool]]:
        """Lays out a conversation in the model's chat format and says which tokens are trained on.

        Args:
            messages: dicts with ``role`` (system, user or assistant) and ``content`` (str), optionally
                ``reasoning_content`` (str, rendered by formats that show reasoning: Qwen3's).
            add_eos: end with eos (unless the format already ends there); it is trained when the token before is.
            train_on: ``"assistant"``: each assistant message's body as the format lays it out (content and
                closing token; Qwen3's format trains only the turns after the last user query, think block
                included); ``"last_turn"``: only the last assistant message's; ``"all"``: every token but the
                first.

        Returns:
            ``(tokens, mask)`` of equal length, truncated to ``max_seq_len``.

        Raises:
            UserError: a malformed message, an unknown ``train_on``, or turns the format cannot express.
        """
        tokens, mask = layout(
            messages, self.chat_format, encode=self.engine.encode, special_id=self.special_id, train_on=train_on
        )
        if add_eos and (not tokens or tokens[-1] != self._eos_id):
            mask.append(bool(mask) and mask[-1])
            tokens.append(self._eos_id)
        return self._truncate(tokens), self._truncate(mask)

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens that prompt the model for the next assistant turn (not truncated: the end is what matters)."""
        tokens, _ = layout(
            messages, self.chat_format, encode=self.engine.encode, special_id=self.special_id, train_on="assistant",
            add_generation_prompt=True,
        )
        return tokens

    def _truncate(self, seq: list) -> list:
        return seq if self.max_seq_len is None else seq[: self.max_seq_len]
