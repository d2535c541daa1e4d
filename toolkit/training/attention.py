"""Which attention kernel a run uses, and each batch's attention mask, built on the device.

Packed rows (``input_pos`` restarting at every document) need attention confined to each document. On CUDA that
is FlexAttention with a block mask (:class:`~toolkit.modules.DocumentMasks`), which skips the blocks of scores
that are masked whole and also soft-caps Gemma 2's scores inside its kernel; elsewhere it is SDPA with a dense
``[b, s, s]`` mask. Either way the mask is made here, from ``input_pos`` on the device, not by the data loader:
no ``s x s`` tensor is built on the host and copied over with every batch.
"""

import torch

from toolkit.data.packing import document_ids, packed_attention_mask
from toolkit.errors import UserError
from toolkit.modules import DocumentMasks


def resolve_flex_attention(setting: bool | str | None, device: torch.device) -> bool:
    """Whether a training run uses FlexAttention, from the config's ``flex_attention``.

    Args:
        setting: ``auto`` (or ``None``): on CUDA, yes; ``true``; ``false``: SDPA everywhere (a dense mask for
            packed rows, explicit scores for soft-capped attention).
        device: the run's device.

    Raises:
        UserError: ``true`` off CUDA: PyTorch has no FlexAttention backward on the CPU.
    """
    if setting is None or setting == "auto":
        return device.type == "cuda"
    if not isinstance(setting, bool):
        raise UserError(f"flex_attention: expected auto, true or false, got {setting!r}")
    if setting and device.type == "cpu":
        raise UserError(
            "flex_attention: true needs a GPU: PyTorch computes FlexAttention's gradients only on CUDA; "
            "set flex_attention=auto (SDPA on the CPU)"
        )
    return setting


def batch_attention_mask(
    batch: dict[str, torch.Tensor], *, flex_attention: bool
) -> torch.Tensor | DocumentMasks | None:
    """The ``mask`` to give the decoder for a batch already on its device.

    Args:
        batch: ``tokens``, and for packed rows ``input_pos`` (positions restarting at 0 at every document), as
            :func:`~toolkit.data.padded_collate` makes them; a ``mask`` it already holds is used as it is
            for unpacked rows, and rebuilt from ``input_pos`` for packed ones under FlexAttention.
        flex_attention: the run uses FlexAttention (:func:`resolve_flex_attention`).

    Returns:
        ``None`` (causal) for unpacked rows on SDPA; a dense boolean ``[b, s, s]`` mask for packed rows on SDPA;
        :class:`~toolkit.modules.DocumentMasks` under FlexAttention (it keeps SDPA's causal kernel for the layers
        of unpacked rows that need neither a window nor a soft-cap).
    """
    input_pos = batch.get("input_pos")
    tokens = batch["tokens"]
    if input_pos is None:
        if "mask" in batch or not flex_attention:
            return batch.get("mask")
        return DocumentMasks(None, seq_len=tokens.shape[-1], device=tokens.device)
    if flex_attention:
        return DocumentMasks(document_ids(input_pos), seq_len=tokens.shape[-1], device=tokens.device)
    return batch["mask"] if "mask" in batch else packed_attention_mask(input_pos)
