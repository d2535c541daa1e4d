"""Materializing models built on the meta device."""

import random

import torch
from torch import nn

from toolkit.modules._dtensor import init_full_
from toolkit.modules.peft.nf4 import is_nf4
from toolkit.modules.peft.nf4_experts import NF4Stack


def materialize(
    model: nn.Module,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    buffer_device: torch.device | None = None,
) -> nn.Module:
    """Allocate a meta-device model's storage on ``device`` (values undefined) and rebuild derived buffers.

    ``buffer_device`` (default ``device``) holds the buffers instead: with FSDP2's CPU offload the parameters live
    in host memory and the buffers where the layers run. Follow it with :func:`init_weights` or a checkpoint load.
    """
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    if buffer_device is not None:  # (a buffer already there stays the same tensor)
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(buffer_device)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model


@torch.no_grad()
def init_weights(model: nn.Module, *, std: float = 0.02) -> None:
    """Initialize from scratch: every matrix parameter (linear, embedding, stacked experts, and the frozen base
    weights of adapter layers) from normal(0, std), biases at zero, and other leaf modules (norms) by their own
    ``reset_parameters``. Draws from the global torch RNG in a fixed order, so the same seed gives the same model
    on every rank. Adapter layers reset their own adapters afterwards (``init_adapters``)."""
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if isinstance(module, NF4Stack):  # QLoRA's experts: quantized one by one from what a plain stack would draw
            module.quantize_all_(torch.empty(module.shape, device=module.codes.device).normal_(0.0, std))
        elif "weight" in own and own["weight"].dim() >= 2:
            weight = own["weight"]
            if is_nf4(weight):  # a QLoRA base: NF4 has no in-place normal_, but copy_ quantizes what it is given
                weight.copy_(torch.empty(weight.shape, dtype=torch.float32, device=weight.device).normal_(0.0, std))
            else:  # a sharded weight gets the values the whole one would
                init_full_(weight, lambda w: nn.init.normal_(w, mean=0.0, std=std))
            if own.get("bias") is not None:
                nn.init.zeros_(own["bias"])
        elif own and all(param.dim() == 3 for param in own.values()):  # stacked experts: [experts, out, in] each
            for param in own.values():
                init_full_(param, lambda w: nn.init.normal_(w, mean=0.0, std=std))
        elif own and hasattr(module, "reset_parameters"):
            module.reset_parameters()


def set_seed(seed: int) -> None:
    """Seed Python's, and torch's CPU and CUDA generators."""
    random.seed(seed)
    torch.manual_seed(seed)
