"""Load a Hugging Face checkpoint folder as a ready model: the one helper that needs both the model families
(:mod:`toolkit.models`) and the checkpoint code (:mod:`toolkit.training`). It sits above both, so that models and
modules never import training or checkpoint code."""

from pathlib import Path

import torch
from torch import nn

from toolkit.models import build_from_hf, read_hf_config
from toolkit.checkpoint.hf import HFCheckpointer
from toolkit.training.init import materialize


def from_pretrained(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> nn.Module:
    """Build the model a Hugging Face checkpoint folder describes and load its weights.

    The family comes from ``config.json``'s ``model_type``, the dimensions from its other fields. The model is
    built on the meta device, materialized on ``device`` in ``dtype``, then filled from the safetensors files
    (single or sharded with an index), so memory holds one copy of the weights.

    Args:
        path: folder with ``config.json`` and ``*.safetensors``.
        dtype: parameter dtype.
        device: where the weights go.
        max_seq_len: rotary cache length; defaults to the file's ``max_position_embeddings``.

    Raises:
        UserError: no or unreadable ``config.json``, a ``model_type`` no family handles, a missing field, or a
            weight that does not fit the model; the message names the file.
    """
    with torch.device("meta"):
        model = build_from_hf(path=path, max_seq_len=max_seq_len)
    materialize(model, device=torch.device(device), dtype=dtype)
    HFCheckpointer(str(Path(path).expanduser()), model_family=read_hf_config(path)[1]).load(model)
    return model


__all__ = ["from_pretrained"]
