"""The gated feed-forward block (SwiGLU, Shazeer 2020, https://arxiv.org/abs/2002.05202)."""

import torch
from torch import nn


class FeedForward(nn.Module):
    """``down_proj(activation(gate_proj(x)) * up_proj(x))``.

    Args:
        gate_proj: projection whose output goes through the activation.
        down_proj: projection back to the model dimension.
        up_proj: the linear (ungated) branch.
        activation: SiLU for SwiGLU; GELU (tanh) for Gemma's GeGLU.
    """

    def __init__(self, *, gate_proj: nn.Module, down_proj: nn.Module, up_proj: nn.Module, activation: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_proj = gate_proj
        self.down_proj = down_proj
        self.up_proj = up_proj
        self.activation = activation if activation is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x)) * self.up_proj(x))
