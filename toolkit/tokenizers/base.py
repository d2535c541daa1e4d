"""The interface every tokenizer in ``toolkit.tokenizers`` offers to datasets, recipes and generation."""

from typing import Iterable, Protocol

# Which tokens of a conversation are training targets; see ChatTokenizer.tokenize_messages.
TRAIN_ON: tuple[str, ...] = ("assistant", "last_turn", "all")


class ChatTokenizer(Protocol):
    """What datasets and generation need from a tokenizer, whichever vocabulary backs it.

    Messages are dicts ``{"role": "system" | "user" | "assistant", "content": str}``, assistant ones optionally
    with ``"reasoning_content": str`` (chat formats whose model shows reasoning render it). Masks returned by
    :meth:`tokenize_messages` say per token whether it is trained on (``True``) or only context (``False``).
    """

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def stop_tokens(self) -> list[int]: ...

    max_seq_len: int | None

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str: ...

    def tokenize_messages(
        self, messages: list[dict], *, add_eos: bool = True, train_on: str = "assistant"
    ) -> tuple[list[int], list[bool]]: ...

    def prompt_tokens(self, messages: list[dict]) -> list[int]: ...
