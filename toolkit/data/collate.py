"""Batching variable-length samples, packed or not."""

from typing import Sequence

import torch

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.data.packing import packed_attention_mask


def padded_collate(
    batch: list[dict],
    *,
    pad_id: int,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    pad_to_multiple_of: int = 1,
    attention_mask: bool = True,
    pack_to: int | None = None,
    lengths: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pads ``{"tokens", "labels"}`` samples into tensors; packed samples also get their attention mask.

    Args:
        batch: samples whose ``tokens`` and ``labels`` are equal-length lists of ints, and, for packed samples,
            ``input_pos`` (positions restarting at 0 at each document).
        pad_id: fills ``tokens`` past each sample's end.
        ignore_index: fills ``labels`` past each sample's end, so padding is never a target.
        pad_to_multiple_of: round the padded length up to a multiple of this (steadier shapes for kernels and
            ``torch.compile``).
        attention_mask: add the dense mask of packed batches; ``False`` leaves it to the trainer, which builds it
            (or a FlexAttention block mask) on the device from ``input_pos``
            (:func:`toolkit.training.batch_attention_mask`).
        pack_to: pad packed batches to this many positions (the pack size), so that every packed batch has the
            same shape: compiled kernels (FlexAttention's among them) are then compiled once, where each new
            length would compile again, and past torch's recompile limit run unfused. Unpacked batches keep
            their own length.
        lengths: pad to the shortest of these that holds the longest sample, so that batches take only these
            shapes (a model compiled for static shapes compiles once per length:
            :func:`toolkit.training.compile.static_lengths`); a longer sample keeps its own length.

    Returns:
        ``{"tokens": LongTensor[b, s], "labels": LongTensor[b, s], "lengths": LongTensor[b]}`` with ``s`` the
        longest sample rounded up and ``lengths`` each row's length before its padding.
        If any sample has ``input_pos``, also ``"input_pos": LongTensor[b, s]`` and, with ``attention_mask``,
        ``"mask": BoolTensor[b, s, s]`` (True where attention is allowed: causal and within a document). A sample
        without ``input_pos`` counts as one document, and the padding of each row as one more, so no row of the
        mask is empty.
    """
    if not batch:
        raise ValueError("padded_collate got an empty batch")
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    for i, sample in enumerate(batch):
        if len(sample["tokens"]) != len(sample["labels"]):
            raise ValueError(
                f"sample {i} of the batch has {len(sample['tokens'])} tokens but {len(sample['labels'])} labels"
            )
        if "input_pos" in sample and len(sample["input_pos"]) != len(sample["tokens"]):
            raise ValueError(
                f"sample {i} of the batch has {len(sample['tokens'])} tokens but {len(sample['input_pos'])} "
                "input_pos"
            )
    longest = max(len(sample["tokens"]) for sample in batch)
    packed = any("input_pos" in sample for sample in batch)
    if packed and pack_to is not None:
        longest = max(longest, pack_to)
    longest = min((n for n in lengths or () if n >= longest), default=longest)
    seq_len = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    out = {
        "tokens": _pad([s["tokens"] for s in batch], seq_len, pad_id),  # [b, s]
        "labels": _pad([s["labels"] for s in batch], seq_len, ignore_index),  # [b, s]
        "lengths": torch.tensor([len(s["tokens"]) for s in batch], dtype=torch.long),  # [b]
    }
    if packed:
        input_pos = torch.arange(seq_len).repeat(len(batch), 1)  # [b, s]
        for i, sample in enumerate(batch):
            n = len(sample["tokens"])
            if "input_pos" in sample:
                input_pos[i, :n] = torch.as_tensor(sample["input_pos"], dtype=torch.long)
            # The padding starts a document of its own: it attends only to itself, and no token to it.
            input_pos[i, n:] = torch.arange(seq_len - n)
        out["input_pos"] = input_pos
        if attention_mask:
            out["mask"] = packed_attention_mask(input_pos)  # [b, s, s]
    return out


def preference_collate(
    batch: list[dict],
    *,
    pad_id: int,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    pad_to_multiple_of: int = 1,
    lengths: Sequence[int] | None = None,
    rows: tuple[str, str] = ("chosen", "rejected"),
) -> dict[str, torch.Tensor]:
    """Pads preference pairs into one batch: the ``b`` chosen sequences, then the ``b`` rejected ones.

    One forward pass then scores both halves, as preference losses (DPO and kin) need. ``pad_to_multiple_of`` and
    ``lengths`` as in :func:`padded_collate`. ``rows`` names the two sequences of a sample (``<name>_tokens``,
    ``<name>_labels``): ``("completion", "kl")`` for KTO's (:class:`~toolkit.data.UnpairedDataset`).

    Returns:
        ``{"tokens": LongTensor[2b, s], "labels": LongTensor[2b, s], "lengths": LongTensor[2b]}``; rows ``:b`` are
        chosen, ``b:`` rejected. Samples that carry their reference's log-probabilities (``ref_logps``, one per
        sequence: :class:`~toolkit.objectives.preference.WithReferenceLogps`) also give ``"ref_logps":
        FloatTensor[2b]`` in the same order; KTO's samples give ``"desirable": BoolTensor[b]``.
    """
    halves = [
        {"tokens": sample[f"{name}_tokens"], "labels": sample[f"{name}_labels"]}
        for name in rows
        for sample in batch
    ]
    out = padded_collate(halves, pad_id=pad_id, ignore_index=ignore_index, pad_to_multiple_of=pad_to_multiple_of,
                         lengths=lengths)
    if "ref_logps" in batch[0]:
        out["ref_logps"] = torch.tensor([s["ref_logps"][k] for k in range(2) for s in batch], dtype=torch.float32)
    if "desirable" in batch[0]:
        out["desirable"] = torch.tensor([s["desirable"] for s in batch], dtype=torch.bool)
    return out


def kto_collate(batch: list[dict], **kwargs) -> dict[str, torch.Tensor]:
    """:func:`preference_collate` for KTO's samples: rows ``:b`` the answers, ``b:`` each prompt with another
    sample's answer (the KL estimate's), and ``"desirable": BoolTensor[b]``; the same keyword arguments."""
    return preference_collate(batch, rows=("completion", "kl"), **kwargs)


def _pad(rows: Sequence[Sequence[int]], seq_len: int, value: int) -> torch.Tensor:
    out = torch.full((len(rows), seq_len), value, dtype=torch.long)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
    return out
