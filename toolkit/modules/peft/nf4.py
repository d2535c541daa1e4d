"""Frozen base weights stored in 4-bit NormalFloat (NF4), the storage format of QLoRA (Dettmers et al., 2023,
https://arxiv.org/abs/2305.14314), through torchao's ``NF4Tensor``.

NF4 splits the flattened weight into blocks of 64 values, scales each block by its absolute maximum, and stores
each scaled value as the index (4 bits) of the nearest of 16 levels spaced as quantiles of a normal distribution.
The per-block scales are quantized again ("double quantization"): their mean is subtracted and the rest stored as
int8 with one scale per group of 256 blocks. Dequantization is ``level[index] * scale``; a linear layer
dequantizes on the fly and never keeps the full-precision weight.

torchao is imported on first use only (its import is slow and logs warnings on CPU-only machines), so models
without quantized weights never load it.
"""

import dataclasses
import functools
import logging
import warnings
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

NF4_BLOCK_SIZE = 64
"""Weights per absmax-scaled block (QLoRA's choice)."""

MAX_SCALER_BLOCK_SIZE = 256
"""Block scales per double-quantization group (QLoRA's choice); smaller for weights with fewer blocks."""

SHARDABLE_GROUPS = 8
"""Double-quantization groups per weight are kept a multiple of this when possible, so that FSDP2 can shard the
NF4 weight over 2, 4 or 8 ranks."""

_torchao: ModuleType | None = None


def _torchao_quantization() -> ModuleType:
    """The torchao module with ``NF4Tensor`` and ``to_nf4`` (``torchao.quantization``; ``torchao.dtypes`` before
    0.11), imported once, with the warnings its import logs on CPU silenced."""
    global _torchao
    if _torchao is None:
        loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
        levels = [logger.level for logger in loggers]
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            # On the CPU: the first import may come while a model is built under ``torch.device("meta")``, and
            # torchao builds tables at import (0.10's 4-bit optimizer reads one back with .tolist(), which fails on
            # the meta device); an import outside any device context puts them there too.
            with warnings.catch_warnings(), torch.device("cpu"):
                warnings.simplefilter("ignore")
                import torchao.quantization as quantization

                if not hasattr(quantization, "to_nf4"):  # torchao before 0.11 keeps NF4 in torchao.dtypes
                    import torchao.dtypes as quantization
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
        _torchao = quantization
    return _torchao


def is_nf4(tensor: torch.Tensor | None) -> bool:
    """Whether ``tensor`` is a torchao ``NF4Tensor`` (without importing torchao when it was never used)."""
    return _torchao is not None and isinstance(tensor, _torchao.NF4Tensor)


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """Quantize ``weight`` (2-D, any float dtype, any device including meta) to an ``NF4Tensor``.

    The double-quantization group is the largest divisor of the block count up to 256 that leaves a multiple of
    8 groups (FSDP2 shards each part by rows), so small layers (a 64 x 128 projection has 128 blocks) quantize and
    shard too; real model layers get QLoRA's 256.

    Raises:
        ValueError: the weight's element count is not a multiple of the 64-value block.
    """
    numel = weight.numel()
    if numel % NF4_BLOCK_SIZE:
        raise ValueError(
            f"NF4 needs a weight whose element count is a multiple of {NF4_BLOCK_SIZE}; got shape {tuple(weight.shape)}"
        )
    n_blocks = numel // NF4_BLOCK_SIZE
    if weight.device.type == "meta":
        return _meta_nf4(weight, n_blocks=n_blocks, scaler_block_size=scaler_block_size(numel))
    return _torchao_quantization().to_nf4(weight.detach(), NF4_BLOCK_SIZE, scaler_block_size(numel))


def scaler_block_size(numel: int) -> int:
    """The double-quantization group (in blocks) of a weight of ``numel`` values (a multiple of the block): see
    :func:`to_nf4`."""
    n_blocks = numel // NF4_BLOCK_SIZE
    divisors = [d for d in range(1, min(MAX_SCALER_BLOCK_SIZE, n_blocks) + 1) if n_blocks % d == 0]
    # FSDP2 splits each of the NF4 tensor's parts into equal row chunks, one per rank: keep the number of groups a
    # multiple of SHARDABLE_GROUPS where the weight allows it (real layers already have thousands of groups).
    shardable = [d for d in divisors if (n_blocks // d) % SHARDABLE_GROUPS == 0]
    return max(shardable or divisors)


@functools.cache
def _meta_template(dtype: torch.dtype, scaler_block_size: int) -> torch.Tensor:
    size = scaler_block_size * NF4_BLOCK_SIZE
    template = torch.empty(size, dtype=dtype, device="meta")
    return _torchao_quantization().to_nf4(template, NF4_BLOCK_SIZE, scaler_block_size)


def _meta_nf4(weight: torch.Tensor, *, n_blocks: int, scaler_block_size: int) -> torch.Tensor:
    # On the meta device quantizing computes nothing, yet torchao still walks the weight in 1M-value chunks:
    # ~0.1 s for a 8B MLP projection, minutes for a 70B model. Quantize a one-group template instead and give
    # it inner tensors of the weight's sizes (tests check the layout against a real quantization).
    template = _meta_template(weight.dtype, scaler_block_size)
    names, ctx = template.__tensor_flatten__()
    inner = {name: getattr(template, name) for name in names}
    inner["quantized_data"] = torch.empty(weight.numel() // 2, dtype=torch.uint8, device="meta")
    inner["quantized_scalers"] = torch.empty(n_blocks, dtype=torch.int8, device="meta")
    inner["quantization_factor"] = torch.empty(n_blocks // scaler_block_size, dtype=weight.dtype, device="meta")
    tensor_meta = dataclasses.replace(
        ctx["tensor_meta"], original_shape=weight.shape, original_strides=weight.stride(), requires_grad=False
    )
    ctx = dict(ctx, n_blocks=n_blocks, tensor_meta=tensor_meta)
    return type(template).__tensor_unflatten__(inner, ctx, weight.size(), weight.stride())


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """The full-precision values of ``weight``: dequantized if it is NF4, else ``weight`` itself."""
    return weight.get_original_weight() if is_nf4(weight) else weight


def apply_to_nf4(weight: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Apply a ``Module._apply`` function (``to``, ``to_empty``, ``cuda``, ``half``...) to an ``NF4Tensor``,
    keeping it NF4.

    Applied to the NF4 tensor itself, ``.to(dtype)`` would dequantize it to a full-size tensor and ``to_empty``
    would leave part of it on the meta device. Applied to its inner tensors, these stay what they should be:
    codes stay integers, scales and levels take the new dtype, everything moves to the new device. What ``fn``
    does to an empty tensor of the weight's dtype and device says which dtype and device the result has.
    """
    probe = fn(torch.empty(0, dtype=weight.dtype, device=weight.device))
    names, ctx = weight.__tensor_flatten__()
    inner = {name: fn(getattr(weight, name)) for name in names}
    ctx = dict(ctx, tensor_meta=dataclasses.replace(ctx["tensor_meta"], dtype=probe.dtype, device=probe.device))
    return type(weight).__tensor_unflatten__(inner, ctx, weight.size(), weight.stride())


def _apply_keeping_nf4(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], apply_rest: Callable[[], nn.Module]
) -> nn.Module:
    # Shared by NF4Linear and LoRALinear: Module._apply would replace an NF4 weight by fn(weight), which
    # dequantizes it (see apply_to_nf4). Hide the weight from it, then apply fn to the NF4 weight here. Setting
    # the slot to None (rather than removing it) keeps the parameter order, hence the state_dict order.
    weight = module._parameters.get("weight")
    if not is_nf4(weight):
        return apply_rest()
    module._parameters["weight"] = None
    try:
        apply_rest()
    finally:
        module._parameters["weight"] = weight
    module._parameters["weight"] = nn.Parameter(apply_to_nf4(weight, fn), requires_grad=False)
    return module


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is stored in NF4 and dequantized on the fly.

    QLoRA's base model projections that get no adapter. The state-dict keys are a plain linear's (``weight``,
    ``bias``), and a checkpoint loads by ``state_dict()[key].copy_(full_precision_tensor)``, which quantizes.

    Args:
        in_dim: input features.
        out_dim: output features.
        use_bias: add a (frozen, unquantized) bias.
    """

    def __init__(self, in_dim: int, out_dim: int, *, use_bias: bool = False) -> None:
        super().__init__()
        base = nn.Linear(in_dim, out_dim, bias=use_bias)
        self.in_dim = in_dim
        self.out_dim = out_dim
        self.weight = nn.Parameter(to_nf4(base.weight), requires_grad=False)
        self.bias = nn.Parameter(base.bias.detach(), requires_grad=False) if use_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.linear on an NF4Tensor dequantizes in the forward and again in the backward (torchao's LinearNF4),
        # so the full-precision weight is never saved for backward.
        return F.linear(x, self.weight, self.bias)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        return _apply_keeping_nf4(self, fn, lambda: super(NF4Linear, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        return f"in_dim={self.in_dim}, out_dim={self.out_dim}, bias={self.bias is not None}, weight=NF4"
