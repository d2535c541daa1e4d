"""Root-mean-square layer normalization (Zhang & Sennrich, 2019)."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32 whatever the input dtype.

    Normalizing in float32 and casting back before the scale matches what Llama's reference code and
    ``transformers`` do, which matters for bit-level parity in bf16.

    Args:
        dim: size of the last dimension.
        eps: added to the mean square for numerical stability.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)
