"""Data-parallel wrappers applied to a plain model from outside (the model knows nothing of them)."""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, *, device: torch.device) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel (its parameters already on ``device``).

    Only parameters with ``requires_grad`` are registered for all-reduce, so with a frozen base (LoRA) only
    the adapters' gradients cross the network.
    """
    return DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        # Every trainable parameter gets a gradient each step in our models; declaring it lets DDP skip the
        # graph traversal that find_unused_parameters would need.
        find_unused_parameters=False,
        # Reuse gradient buckets as .grad storage: less memory and one copy fewer per step.
        gradient_as_bucket_view=True,
    )


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Skip data-parallel gradient reduction inside the block when ``enabled`` is False.

    Use it on every micro-step but the last of an optimizer step: the gradients accumulate locally and are
    reduced once, instead of once per micro-step.
    """
    if enabled or not isinstance(model, DistributedDataParallel):
        yield
        return
    with model.no_sync():
        yield
