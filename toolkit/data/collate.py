"""Batching variable-length samples."""

import torch

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX


def padded_collate(
    batch: list[dict],
    *,
    pad_id: int,
    ignore_index: int = CROSS_ENTROPY_IGNORE_INDEX,
    pad_to_multiple_of: int = 1,
) -> dict[str, torch.Tensor]:
    """Right-pads ``{"tokens", "labels"}`` samples into tensors.

    Args:
        batch: samples whose ``tokens`` and ``labels`` are equal-length lists of ints.
        pad_id: fills ``tokens`` past each sample's end.
        ignore_index: fills ``labels`` past each sample's end, so padding is never a target.
        pad_to_multiple_of: round the padded length up to a multiple of this (steadier shapes for kernels and
            ``torch.compile``).

    Returns:
        ``{"tokens": LongTensor[b, s], "labels": LongTensor[b, s]}`` with ``s`` the longest sample rounded up.
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
    longest = max(len(sample["tokens"]) for sample in batch)
    seq_len = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    tokens = torch.full((len(batch), seq_len), pad_id, dtype=torch.long)  # [b, s]
    labels = torch.full((len(batch), seq_len), ignore_index, dtype=torch.long)  # [b, s]
    for i, sample in enumerate(batch):
        n = len(sample["tokens"])
        tokens[i, :n] = torch.tensor(sample["tokens"], dtype=torch.long)
        labels[i, :n] = torch.tensor(sample["labels"], dtype=torch.long)
    return {"tokens": tokens, "labels": labels}
