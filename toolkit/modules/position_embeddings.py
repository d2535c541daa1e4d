"""Rotary position embeddings (Su et al., 2021, https://arxiv.org/abs/2104.09864).

We rotate in the "half" layout used by Hugging Face checkpoints: the first half of each head's features pairs
with the second half. Meta's original checkpoints pair adjacent features instead; their q/k projections are
permuted on load (see the families' weight conversion), so one fast implementation serves both.
"""

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency scaling for long context: low frequencies are divided by ``factor``, high ones
    kept, and the band between is interpolated smoothly (values from Meta's Llama 3.1 release)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def apply(self, inv_freq: torch.Tensor) -> torch.Tensor:
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, interpolated)
        return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


class RotaryPositionalEmbeddings(nn.Module):
    """Rotates query or key features by position-dependent angles.

    Args:
        head_dim: features per head (even).
        max_seq_len: longest sequence the cos/sin cache covers.
        base: the rotary base (theta).
        scaling: optional Llama 3.1 frequency scaling.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int = 4096,
        base: float = 10_000.0,
        scaling: Llama3RopeScaling | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.scaling = scaling
        # Derived buffers are not saved in checkpoints; reset_buffers() rebuilds them after meta-device init.
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        if not self.cos.is_meta:
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the cos/sin cache (in float64 for accuracy at long positions, stored as float32)."""
        device = self.cos.device
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim))
        if self.scaling is not None:
            inv_freq = self.scaling.apply(inv_freq)
        positions = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)  # [max_seq_len, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)  # [max_seq_len, head_dim]
        self.cos = angles.cos().float()
        self.sin = angles.sin().float()

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[b, n_h, s, h_d]``.

        Args:
            x: queries or keys.
            input_pos: positions ``[s]`` or ``[b, s]``; ``None`` means ``0..s-1``.
        """
        seq_len = x.shape[-2]
        if input_pos is None:
            cos, sin = self.cos[:seq_len], self.sin[:seq_len]  # [s, h_d]
        else:
            cos, sin = self.cos[input_pos], self.sin[input_pos]  # [s, h_d] or [b, s, h_d]
            if cos.dim() == 3:
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, h_d]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)
