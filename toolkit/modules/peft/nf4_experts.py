"""QLoRA for mixture-of-experts models: the stacked expert weights stored in NF4, one quantization per expert.

An expert block's projection is ``[num_experts, out, in]`` (``toolkit.modules.moe.GroupedExperts``), nearly all of
an MoE model's weights. :class:`NF4Stack` keeps it in NF4 as QLoRA keeps a linear layer's weight
(``toolkit.modules.peft.nf4``): blocks of 64 values scaled by their absolute maximum, each value the 4-bit index of
the nearest NF4 level, the block scales quantized again to int8 in groups. Each expert is quantized on its own
(its own scale mean), exactly as :func:`~toolkit.modules.peft.nf4.to_nf4` quantizes that expert's ``[out, in]``
matrix, so a checkpoint loads one expert at a time and any expert-wise split of the stack holds whole experts.

The four parts are parameters (frozen) whose first dimension is the expert: expert parallelism and FSDP2 split them
as they split any stacked weight, along the experts, each rank keeping whole experts' codes and scales. The grouped matmul dequantizes
all experts of a projection at once in the forward and again in the backward (:class:`_NF4GroupedMM`), so only the
4-bit codes are kept between them, as torchao's ``LinearNF4`` does for a linear layer.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from toolkit.modules._dtensor import local_region
from toolkit.modules.moe import PROJECTIONS, GroupedExperts, grouped_mm, local
from toolkit.modules.peft.nf4 import NF4_BLOCK_SIZE, NF4Linear, scaler_block_size, to_nf4

NF4_LEVELS = (
    -1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
    0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0,
)
"""The 16 NF4 values (quantiles of a standard normal scaled to [-1, 1], Dettmers et al., 2023, appendix E), as
torchao's NF4 stores them; an index ``i`` of a code means ``NF4_LEVELS[i]`` times its block's scale."""


class NF4Stack(nn.Module):
    """A frozen stack of ``num_experts`` matrices ``[out_dim, in_dim]`` stored in NF4, expert by expert.

    Parameters (all frozen, first dimension the expert): ``codes`` ``[E, out * in / 2]`` (uint8, two 4-bit indices a
    byte, the first in the high bits), ``scalers`` ``[E, blocks]`` (int8: each 64-value block's scale, less the
    expert's ``means``, times its group's ``factors``), ``factors`` ``[E, groups]`` and ``means`` ``[E]`` (in the
    nominal dtype). Called with rows grouped by expert, it computes :func:`~toolkit.modules.moe.grouped_mm` of them
    with the dequantized matrices.

    Args:
        num_experts: matrices in the stack.
        out_dim: rows of each.
        in_dim: columns of each; ``out_dim * in_dim`` must be a multiple of 64.
        dtype: the nominal dtype (of the scales, and of the dequantized weights).

    Raises:
        ValueError: ``out_dim * in_dim`` is not a multiple of 64.
    """

    def __init__(self, num_experts: int, out_dim: int, in_dim: int, *, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        numel = out_dim * in_dim
        if numel % NF4_BLOCK_SIZE:
            raise ValueError(f"NF4 needs matrices whose element count is a multiple of {NF4_BLOCK_SIZE}; "
                             f"got {out_dim} x {in_dim}")
        blocks = numel // NF4_BLOCK_SIZE
        self.shape = torch.Size((num_experts, out_dim, in_dim))
        self.scaler_block_size = scaler_block_size(numel)
        dtype = dtype or torch.get_default_dtype()

        def frozen(*size: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.zeros(num_experts, *size, dtype=dtype), requires_grad=False)

        self.codes = frozen(numel // 2, dtype=torch.uint8)
        self.scalers = frozen(blocks, dtype=torch.int8)
        self.factors = frozen(blocks // self.scaler_block_size, dtype=dtype)
        self.means = frozen(dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The nominal dtype: of the scales, and of the dequantized weights."""
        return self.factors.dtype

    @torch.no_grad()
    def quantize_(self, index: int, weight: torch.Tensor) -> None:
        """Store expert ``index``'s matrix ``weight`` ``[out_dim, in_dim]`` (any float dtype), quantized as
        :func:`~toolkit.modules.peft.nf4.to_nf4` quantizes it, in the nominal dtype, on this stack's device. In a
        stack split along its experts (expert parallelism, FSDP2), only the rank holding expert ``index`` stores it;
        the others return at once."""
        if tuple(weight.shape) != tuple(self.shape[1:]):
            raise ValueError(f"expert {index}: expected shape {tuple(self.shape[1:])}, got {tuple(weight.shape)}")
        parts = (self.codes, self.scalers, self.factors, self.means)
        if isinstance(self.codes, DTensor):  # every part is split alike: they all have the experts first
            held = local_region(self.codes)[0]
            if not held.start <= index < held.stop:
                return
            index, parts = index - held.start, tuple(part.to_local() for part in parts)
        nf4 = to_nf4(weight.to(device=parts[0].device, dtype=self.dtype).contiguous())
        for part, values in zip(parts, (nf4.quantized_data, nf4.quantized_scalers, nf4.quantization_factor,
                                        nf4.scaler_mean)):
            part[index].copy_(values)

    @torch.no_grad()
    def quantize_all_(self, weights: torch.Tensor) -> None:
        """Store every expert's matrix: ``weights`` ``[num_experts, out_dim, in_dim]``."""
        for index, weight in enumerate(weights):
            self.quantize_(index, weight)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Every expert's matrix ``[num_experts, out_dim, in_dim]`` (this rank's experts when sharded along them), in
        ``dtype`` (default: the nominal one); each equals what torchao's ``NF4Tensor`` of that expert dequantizes to."""
        return _dequantize(*self._local_parts(), shape=self.shape[1:],
                           scaler_block_size=self.scaler_block_size).to(dtype or self.dtype)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` ``[n, in_dim]``, its rows grouped by expert (``counts[e]`` each), times each expert's matrix
        transposed: ``[n, out_dim]``; a gradient flows to ``x`` only."""
        return _NF4GroupedMM.apply(x, counts, self.shape[1:], self.scaler_block_size, *self._local_parts())

    def _local_parts(self) -> tuple[torch.Tensor, ...]:
        # This rank's codes, scalers, factors and means (its experts, when split along them).
        return tuple(local(p) for p in (self.codes, self.scalers, self.factors, self.means))

    def extra_repr(self) -> str:
        experts, out_dim, in_dim = self.shape
        return f"num_experts={experts}, out_dim={out_dim}, in_dim={in_dim}, weight=NF4"


def _dequantize(codes, scalers, factors, means, *, shape: torch.Size, scaler_block_size: int) -> torch.Tensor:
    # torchao's NF4Tensor.get_original_weight for every expert at once, in the same operations (so the same values):
    # block scales = int8 / factor, in the nominal dtype, plus the mean; value = level[index] * its block's scale.
    experts, blocks = scalers.shape
    levels = torch.tensor(NF4_LEVELS, dtype=factors.dtype, device=codes.device)
    scales = (scalers.view(experts, -1, scaler_block_size) / factors.unsqueeze(-1)).view(experts, blocks)
    scales = scales.to(factors.dtype) + means.unsqueeze(-1)
    indices = torch.stack([codes >> 4, codes & 0b1111], dim=-1).view(experts, blocks, NF4_BLOCK_SIZE).long()
    return (levels[indices] * scales.unsqueeze(-1)).view(experts, *shape)


class _NF4GroupedMM(torch.autograd.Function):
    """:func:`~toolkit.modules.moe.grouped_mm` with an :class:`NF4Stack`'s matrices, dequantized in the forward and
    again in the backward: only the codes and scales are saved, never the full-precision stack."""

    @staticmethod
    def forward(ctx, x, counts, shape, scaler_block_size, *parts):
        ctx.shape, ctx.scaler_block_size = shape, scaler_block_size
        ctx.save_for_backward(counts, *parts)
        weight = _dequantize(*parts, shape=shape, scaler_block_size=scaler_block_size).to(x.dtype)
        return grouped_mm(x, weight, counts)

    @staticmethod
    def backward(ctx, grad):
        counts, *parts = ctx.saved_tensors
        weight = _dequantize(*parts, shape=ctx.shape, scaler_block_size=ctx.scaler_block_size).to(grad.dtype)
        # d(x W_e^T)/dx = grad W_e: grouped_mm with each expert's transpose ([in, out]).
        grad_x = grouped_mm(grad.contiguous(), weight.transpose(-2, -1), counts)
        return grad_x, None, None, None, *(None for _ in parts)


def quantize_experts_(experts: GroupedExperts) -> GroupedExperts:
    """Replace ``experts``' stacked projections by :class:`NF4Stack` s of the same shapes (QLoRA's base), in place,
    on the device they are on (the meta device while a model is built); their values are set by a checkpoint load or
    ``init_weights``. Returns ``experts``."""
    for name in PROJECTIONS:
        weight = getattr(experts, name)
        stack = NF4Stack(*weight.shape, dtype=weight.dtype).to(weight.device)
        delattr(experts, name)
        setattr(experts, name, stack)
    return experts


def nf4_stacks(model: nn.Module) -> dict[str, NF4Stack]:
    """Every :class:`NF4Stack` of ``model``, by its state-dict prefix (``layers.0.mlp.experts.gate_proj``)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, NF4Stack)}


def has_nf4(model: nn.Module) -> bool:
    """Whether ``model`` stores any weight in NF4 (a QLoRA base: linear layers or experts), sharded or not."""
    return any(
        isinstance(module, (NF4Linear, NF4Stack)) or getattr(module, "quantize_base", False)
        for module in model.modules()
    )
