"""Materializing models built on the meta device."""

import random

import torch
from torch import nn


def materialize(model: nn.Module, *, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """Allocate a meta-device model's storage on ``device`` (values undefined) and rebuild derived buffers.

    Follow it with :func:`init_weights` or a checkpoint load.
    """
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model


@torch.no_grad()
def init_weights(model: nn.Module, *, std: float = 0.02) -> None:
    """Initialize from scratch: normal(0, std) weights for linear and embedding layers, zero biases, and each
    other module's own ``reset_parameters`` (norms start at one). Draws from the global torch RNG, so the same
    seed gives the same model on every rank."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif hasattr(module, "reset_parameters") and not list(module.children()):
            module.reset_parameters()


def set_seed(seed: int) -> None:
    """Seed Python's, and torch's CPU and CUDA generators."""
    random.seed(seed)
    torch.manual_seed(seed)
