"""Turning a per-token "trained on" mask into the project's already-shifted labels."""

from typing import Sequence

from toolkit.modules.masks import CROSS_ENTROPY_IGNORE_INDEX


def shifted_labels(
    tokens: Sequence[int], mask: Sequence[bool], *, ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX
) -> list[int]:
    """Labels for next-token prediction, shifted so that ``labels[i]`` is the target of position i.

    Args:
        tokens: the sequence.
        mask: ``mask[j]`` True where token j is trained on (as from ``tokenize_messages``).
        ignore_index: label for positions whose next token is not trained on, and for the last position.

    Returns:
        ``labels`` with ``len(labels) == len(tokens)``: ``labels[i] = tokens[i + 1]`` if ``mask[i + 1]`` else
        ``ignore_index``.
    """
    if len(tokens) != len(mask):
        raise ValueError(f"tokens and mask differ in length: {len(tokens)} vs {len(mask)}")
    labels = [tok if trained else ignore_index for tok, trained in zip(tokens[1:], mask[1:])]
    # The last position has no next token in this sequence.
    return labels + [ignore_index] if tokens else []
