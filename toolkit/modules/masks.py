"""Which positions see which, and which are trained: the masks every model block and loss agrees on.

A packed row lays several documents end to end, its ``input_pos`` restarting at 0 at each; these masks keep
attention inside each document (:func:`packed_attention_mask`, the dense form of
:class:`~toolkit.modules.DocumentMasks`' block masks). A label equal to :data:`CROSS_ENTROPY_IGNORE_INDEX` is not
trained on. They live here, below the data pipeline that builds rows and the losses that read labels, so that a
model block needs nothing from either.
"""

import torch

# What torch.nn.functional.cross_entropy skips by default; every label that is not a target holds it.
CROSS_ENTROPY_IGNORE_INDEX = -100


def document_ids(input_pos: torch.Tensor) -> torch.Tensor:
    """Which document of its row each position belongs to (0, 1, ...), from positions restarting at 0."""
    return torch.cumsum(input_pos == 0, dim=-1) - 1


def packed_attention_mask(input_pos: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask: position i attends to j iff j <= i and both are in the same document.

    Args:
        input_pos: ``[b, s]`` (or ``[s]``) positions, restarting at 0 at every document.

    Returns:
        Bool ``[b, s, s]`` (or ``[s, s]``), True where attention is allowed; every row allows at least its
        diagonal, so no softmax is over an empty set.
    """
    return document_attention_mask(document_ids(input_pos))


def document_attention_mask(documents: torch.Tensor) -> torch.Tensor:
    """:func:`packed_attention_mask` from each position's document (:func:`document_ids`), ``[b, s]`` or ``[s]``."""
    s = documents.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=documents.device).tril()
    return (documents.unsqueeze(-1) == documents.unsqueeze(-2)) & causal
