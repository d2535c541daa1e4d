"""Rotary position embeddings (Su et al., 2021, https://arxiv.org/abs/2104.09864).

We rotate in the "half" layout used by Hugging Face checkpoints: the first half of each head's features pairs
with the second half. Meta's original checkpoints pair adjacent features instead; their q/k projections are
permuted on load (see the families' weight conversion), so one fast implementation serves both.
"""

import math
import weakref
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

    # The rotation's size is unchanged.
    magnitude = 1.0

    def apply(self, inv_freq: torch.Tensor, *, base: float, head_dim: int) -> torch.Tensor:
        old_len = self.original_max_position_embeddings
        low_freq_wavelen = old_len / self.low_freq_factor
        high_freq_wavelen = old_len / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        interpolated = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / self.factor, interpolated)
        return torch.where(wavelen < high_freq_wavelen, inv_freq, scaled)


@dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (Chen et al., 2023, https://arxiv.org/abs/2306.15595): every frequency divided by
    ``factor``, so positions ``factor`` times further apart turn as far as the trained ones did (Gemma 3's global
    layers: 8, from 16,384 to 131,072 positions)."""

    factor: float

    # The rotation's size is unchanged.
    magnitude = 1.0

    def apply(self, inv_freq: torch.Tensor, *, base: float, head_dim: int) -> torch.Tensor:
        return inv_freq / self.factor


@dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (Peng et al., 2023, https://arxiv.org/abs/2309.00071): a context ``factor`` times longer than the
    ``original_max_position_embeddings`` the model was trained at. Rotary frequencies that turn more than
    ``beta_fast`` times over the original context are kept, those that turn fewer than ``beta_slow`` times are
    divided by ``factor``, and the features between are ramped linearly from one to the other (the ramp's ends
    rounded outwards to whole features unless ``truncate`` is false); cos and sin are multiplied by
    ``magnitude``: ``attention_factor`` if given, else ``0.1 ln(factor) + 1`` (with ``mscale`` and
    ``mscale_all_dim``, the ratio of that formula with each as the log's coefficient). Qwen3 reaches 131,072
    tokens this way (factor 4 over 32,768)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def magnitude(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def grown(coefficient: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * coefficient * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return grown(self.mscale) / grown(self.mscale_all_dim)
        return grown(1.0)

    def apply(self, inv_freq: torch.Tensor, *, base: float, head_dim: int) -> torch.Tensor:
        def feature(turns: float) -> float:
            # The feature pair whose wavelength fits the original context ``turns`` times.
            return head_dim * math.log(self.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

        low, high = feature(self.beta_fast), feature(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        if low == high:
            high += 0.001
        pairs = torch.arange(inv_freq.numel(), dtype=inv_freq.dtype, device=inv_freq.device)
        interpolated = ((pairs - low) / (high - low)).clamp(0, 1)  # 0: kept as trained, 1: divided by factor
        return inv_freq / self.factor * interpolated + inv_freq * (1 - interpolated)


class RotaryPositionalEmbeddings(nn.Module):
    """Rotates query or key features by position-dependent angles.

    Args:
        head_dim: features per head (even).
        max_seq_len: longest sequence the cos/sin cache covers.
        base: the rotary base (theta).
        scaling: optional frequency scaling for long context: Llama 3.1's, linear (Gemma 3) or YaRN.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int = 4096,
        base: float = 10_000.0,
        scaling: Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None,
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
        # The cos and sin gathered at the last explicit positions (see _at), while that positions tensor lives.
        self._gathered: tuple | None = None
        if not self.cos.is_meta:
            self.reset_buffers()

    def reset_buffers(self) -> None:
        """Compute the cos/sin cache (in float64 for accuracy at long positions, stored as float32)."""
        device = self.cos.device
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim))
        magnitude = 1.0
        if self.scaling is not None:
            inv_freq = self.scaling.apply(inv_freq, base=self.base, head_dim=self.head_dim)
            magnitude = self.scaling.magnitude
        positions = torch.arange(self.max_seq_len, dtype=torch.float64, device=device)
        angles = torch.outer(positions, inv_freq)  # [max_seq_len, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)  # [max_seq_len, head_dim]
        self.cos = (angles.cos() * magnitude).float()
        self.sin = (angles.sin() * magnitude).float()

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[b, n_h, s, h_d]``.

        Args:
            x: queries or keys.
            input_pos: positions ``[s]`` or ``[b, s]``; ``None`` means ``0..s-1``.
        """
        seq_len = x.shape[-2]
        if input_pos is None:
            cos, sin = self.cos[:seq_len], self.sin[:seq_len]  # [s, h_d]: views, nothing copied
        else:
            cos, sin = self._at(input_pos)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat([-x2, x1], dim=-1)
        return (x * cos + rotated * sin).to(x.dtype)

    def _at(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``input_pos`` (``[s, h_d]``, or ``[b, 1, s, h_d]`` for ``[b, s]`` positions).

        Gathering makes new tensors, which every layer's rotation keeps for backward: for queries and keys, in every
        layer, ``4 x layers`` copies of ``[b, s, h_d]`` float32 per micro-batch (packed rows, context-parallel
        chunks). The layers share this module and are given the same positions tensor, so the gather is made once
        and reused while that tensor lives (and is not modified in place); compiled code gathers inline instead."""
        if torch.compiler.is_compiling():
            return self._gather(input_pos)
        cached = self._gathered
        if cached is not None and cached[0]() is input_pos and cached[1] == input_pos._version and cached[2] == (
                self.cos.data_ptr(), self.cos.device):
            return cached[3], cached[4]
        cos, sin = self._gather(input_pos)
        key = weakref.ref(input_pos, lambda _: setattr(self, "_gathered", None) if self._gathered is entry else None)
        entry = (key, input_pos._version, (self.cos.data_ptr(), self.cos.device), cos, sin)
        self._gathered = entry
        return cos, sin

    def _gather(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos[input_pos], self.sin[input_pos]  # [s, h_d] or [b, s, h_d]
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, h_d]
        return cos, sin
