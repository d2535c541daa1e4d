"""A map-style dataset of conversations, tokenized on access."""

from typing import Sequence

from torch.utils.data import Dataset

from toolkit.data.labels import shifted_labels
from toolkit.errors import UserError
from toolkit.tokenizers import TRAIN_ON, ChatTokenizer


class ChatDataset(Dataset):
    """Conversations as ``{"tokens": list[int], "labels": list[int]}`` items (labels already shifted).

    Tokenizing on access keeps start-up instant on every rank, whatever the size of the dataset.

    Args:
        conversations: one list of messages (``{"role", "content"}`` dicts) per sample.
        tokenizer: any :class:`~toolkit.tokenizers.ChatTokenizer`.
        train_on: which tokens are targets: ``"assistant"``, ``"last_turn"`` or ``"all"``.
        add_eos: end every sample with eos.
    """

    def __init__(
        self,
        conversations: Sequence[list[dict]],
        tokenizer: ChatTokenizer,
        *,
        train_on: str = "assistant",
        add_eos: bool = True,
    ) -> None:
        # Checked here, not at the first item, so that a typo fails before training starts.
        if train_on not in TRAIN_ON:
            raise UserError(f"train_on must be one of {', '.join(TRAIN_ON)}; got {train_on!r}")
        self._conversations = conversations
        self._tokenizer = tokenizer
        self._train_on = train_on
        self._add_eos = add_eos

    def __len__(self) -> int:
        return len(self._conversations)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        try:
            tokens, mask = self._tokenizer.tokenize_messages(
                self._conversations[index], add_eos=self._add_eos, train_on=self._train_on
            )
        except UserError as e:
            raise UserError(f"sample {index}: {e}") from e
        return {"tokens": tokens, "labels": shifted_labels(tokens, mask)}
