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


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (Ding et al., 2024, https://arxiv.org/abs/2402.13753), how Phi-3 128k, Phi-3.5-mini and Phi-4-mini
    reach their long context: each rotary frequency is divided by a factor of its own, from ``short_factor`` for
    sequences up to ``original_max_position_embeddings`` tokens and from ``long_factor`` for longer ones
    (:class:`LongRopeRotaryEmbeddings` switches). cos and sin are multiplied by ``magnitude`` at every length:
    ``attention_factor`` if given, else ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 for a
    ``factor`` of at most 1), ``factor`` being how many times longer the context is than the original one
    (Phi-4-mini: 131,072 / 4,096)."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    factor: float
    attention_factor: float | None = None

    @property
    def magnitude(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1:
            return 1.0
        return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position_embeddings))

    def apply(self, inv_freq: torch.Tensor, *, long: bool) -> torch.Tensor:
        """``inv_freq`` (``[rotary_dim / 2]``) divided by the long or the short factors."""
        factors = self.long_factor if long else self.short_factor
        return inv_freq / torch.tensor(factors, dtype=inv_freq.dtype, device=inv_freq.device)


class RotaryPositionalEmbeddings(nn.Module):
    """Rotates query or key features by position-dependent angles.

    Args:
        head_dim: features per head (even).
        max_seq_len: longest sequence the cos/sin cache covers.
        base: the rotary base (theta).
        scaling: optional frequency scaling for long context: Llama 3.1's, linear (Gemma 3) or YaRN.
        rotary_dim: rotate only the first ``rotary_dim`` features of each head and pass the others through
            unchanged (partial rotary: Phi-4-mini's ``partial_rotary_factor`` 0.75); ``None`` rotates all.
    """

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int = 4096,
        base: float = 10_000.0,
        scaling: Llama3RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary embeddings rotate an even number of features, at most head_dim ({head_dim}); "
                             f"got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_seq_len = max_seq_len
        self.base = base
        self.scaling = scaling
        # Derived buffers are not saved in checkpoints; reset_buffers() rebuilds them after meta-device init.
        self.register_buffer("cos", torch.empty(self._table_rows(), rotary_dim), persistent=False)
        self.register_buffer("sin", torch.empty(self._table_rows(), rotary_dim), persistent=False)
        # The cos and sin gathered at the last explicit positions (see _at), while that positions tensor lives.
        self._gathered: tuple | None = None
        if not self.cos.is_meta:
            self.reset_buffers()

    def _table_rows(self) -> int:
        # Rows of the cos/sin cache: one per position.
        return self.max_seq_len

    def reset_buffers(self) -> None:
        """Compute the cos/sin cache (in float64 for accuracy at long positions, stored as float32)."""
        inv_freq = self._inv_freq()
        magnitude = 1.0
        if self.scaling is not None:
            inv_freq = self.scaling.apply(inv_freq, base=self.base, head_dim=self.rotary_dim)
            magnitude = self.scaling.magnitude
        self.cos, self.sin = self._cos_sin(inv_freq, self.max_seq_len, magnitude)

    def _inv_freq(self) -> torch.Tensor:
        # The unscaled frequency of each rotated feature pair, float64: [rotary_dim / 2].
        pairs = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64, device=self.cos.device)
        return 1.0 / (self.base ** (pairs / self.rotary_dim))

    @staticmethod
    def _cos_sin(inv_freq: torch.Tensor, num_positions: int, magnitude: float) -> tuple[torch.Tensor, torch.Tensor]:
        # cos and sin at positions 0..num_positions-1, float32: [num_positions, rotary_dim] each.
        positions = torch.arange(num_positions, dtype=torch.float64, device=inv_freq.device)
        angles = torch.outer(positions, inv_freq)  # [num_positions, rotary_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)  # [num_positions, rotary_dim]
        return (angles.cos() * magnitude).float(), (angles.sin() * magnitude).float()

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape ``[b, n_h, s, h_d]`` (its first ``rotary_dim`` features).

        Args:
            x: queries or keys.
            input_pos: positions ``[s]`` or ``[b, s]``; ``None`` means ``0..s-1``.
        """
        cos, sin = self._leading(x.shape[-2]) if input_pos is None else self._at(input_pos)
        passed = None
        if self.rotary_dim < self.head_dim:
            x, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)
        return rotated if passed is None else torch.cat([rotated, passed], dim=-1)

    def _leading(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        # cos and sin at positions 0..seq_len-1: [s, rotary_dim] views, nothing copied.
        return self.cos[:seq_len], self.sin[:seq_len]

    def _at(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``input_pos`` (``[s, r]``, or ``[b, 1, s, r]`` for ``[b, s]`` positions; ``r``:
        ``rotary_dim``).

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
        cos, sin = self.cos[input_pos], self.sin[input_pos]  # [s, r] or [b, s, r]
        if cos.dim() == 3:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, s, r]
        return cos, sin


class LongRopeRotaryEmbeddings(RotaryPositionalEmbeddings):
    """Rotary embeddings with LongRoPE's two sets of frequencies (:class:`LongRopeScaling`); the arguments are
    :class:`RotaryPositionalEmbeddings`' (``scaling`` required).

    Each forward rotates all its positions with one set, chosen as transformers' Phi-3 chooses it in a forward without
    a KV cache (``longrope_frequency_update``): the long factors when the largest position plus one exceeds
    ``original_max_position_embeddings``, the short ones otherwise. Without explicit positions that is the
    sequence length of the batch, padding included (Phi-4-mini trains a batch of up to 4096 tokens with the short
    factors, a longer one with the long factors); with explicit positions ``[b, s]`` (packed rows), the largest
    over the whole batch. The choice is made on the device, once per positions tensor: no host sync, no graph
    break. A KV cache filled before the switch holds keys rotated with the short factors: as transformers,
    :func:`toolkit.generation.generate` encodes the whole sequence again once, at the switch. Context parallelism
    is refused (each rank would choose by the positions it holds: a sequence up to ``2 cp / (cp + 1)`` times the
    original context would be rotated with the short factors on some ranks and the long ones on others).

    The cache holds the short table (positions below ``min(original, max_seq_len)``) followed by the long one
    (``max_seq_len`` positions).
    """

    scaling: LongRopeScaling

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        base: float,
        scaling: LongRopeScaling,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__(head_dim, max_seq_len=max_seq_len, base=base, scaling=scaling, rotary_dim=rotary_dim)

    @property
    def _long_start(self) -> int:
        # The cache row of the long table's position 0: the short table before it holds the positions below the
        # original context (or all the model has, when max_seq_len is shorter), the only ones it is used for.
        return min(self.scaling.original_max_position_embeddings, self.max_seq_len)

    def _table_rows(self) -> int:
        return self._long_start + self.max_seq_len

    def reset_buffers(self) -> None:
        """Compute the short and long cos/sin tables (float64, stored as float32)."""
        inv_freq, magnitude = self._inv_freq(), self.scaling.magnitude
        short = self._cos_sin(self.scaling.apply(inv_freq, long=False), self._long_start, magnitude)
        long = self._cos_sin(self.scaling.apply(inv_freq, long=True), self.max_seq_len, magnitude)
        self.cos, self.sin = torch.cat([short[0], long[0]]), torch.cat([short[1], long[1]])

    def _leading(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._long_start if seq_len > self.scaling.original_max_position_embeddings else 0
        return self.cos[start:start + seq_len], self.sin[start:start + seq_len]

    def _gather(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        long = input_pos.max() >= self.scaling.original_max_position_embeddings  # a 0-dim tensor on the device
        return super()._gather(input_pos + long * self._long_start)
