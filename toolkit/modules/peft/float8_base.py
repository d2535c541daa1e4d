"""A frozen weight's linear layer in float8: LoRA's base projection with ``float8: true``.

torchao's ``Float8Linear`` (``toolkit.training.float8``) converts plain ``nn.Linear`` layers; a LoRA layer's base
weight is a parameter of the LoRA layer itself, frozen, so it stays in bf16 there, and in LoRA the base matmuls
are most of the step: the forward ``x W^T`` and the input gradient ``g W``, 4 of the 4N + 6N_lora FLOPs per token.
:func:`float8_frozen_linear` runs both in float8 with the same recipe as torchao's default (one dynamic scale per
tensor, ``scale = max / amax``; e4m3 for the input and the weight, e5m2 for the output gradient, which needs range
more than precision; fast accumulation in the forward matmul, not in the gradient's) through ``torch._scaled_mm``. The weight has no gradient, so its third matmul does not exist.

Nothing is kept in float8 between steps: the weight is cast in forward and again in backward (what autograd saves
is the weight itself, as ``F.linear`` saves it, so FSDP2 frees and re-gathers it as before), which ``torch.compile``
fuses into the neighbouring kernels. CUDA's ``_scaled_mm`` takes its first operand row-major and its second
column-major, both dimensions of the weight multiples of 16 (``toolkit.training.float8`` selects the layers).
"""

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_FLOOR = 1e-12  # an all-zero tensor casts to zeros, not NaN


def to_float8(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` scaled so that its largest magnitude is ``dtype``'s largest value, cast to ``dtype``, and the
    float32 scalar that multiplies it back (``_scaled_mm``'s ``scale_a``/``scale_b``)."""
    largest = torch.finfo(dtype).max
    # The scale divided in float64 and rounded to float32, as torchao's: the same bits eager and compiled.
    scale = (largest / tensor.abs().amax().double().clamp(min=AMAX_FLOOR)).float()
    scaled = (tensor.float() * scale).clamp(-largest, largest).to(dtype)
    return scaled, scale.reciprocal()


class _Float8FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_inverse = to_float8(rows, E4M3)
        w8, w_inverse = to_float8(weight, E4M3)
        # Fast accumulation in the forward matmul only, as torchao's default (the gradient's keeps full precision).
        out = torch._scaled_mm(x8.contiguous(), w8.t(), scale_a=x_inverse, scale_b=w_inverse, out_dtype=x.dtype,
                               use_fast_accum=True)
        ctx.save_for_backward(weight)
        ctx.input_shape = x.shape
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (weight,) = ctx.saved_tensors
        g8, g_inverse = to_float8(grad.reshape(-1, grad.shape[-1]), E5M2)
        w8, w_inverse = to_float8(weight, E4M3)
        column_major = w8.t().contiguous().t()  # [out, in] as the second operand of g @ W
        grad_x = torch._scaled_mm(g8.contiguous(), column_major, scale_a=g_inverse, scale_b=w_inverse,
                                  out_dtype=grad.dtype)
        return grad_x.view(ctx.input_shape), None


def float8_frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a frozen ``weight`` ``[out, in]``, its two matmuls in float8 (see the
    module docstring). ``weight`` and ``bias`` get no gradient."""
    out = _Float8FrozenLinear.apply(x, weight.detach())
    return out if bias is None else out + bias
