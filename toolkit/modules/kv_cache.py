"""A static key/value cache for incremental decoding."""

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of past positions, written in place at ``input_pos``.

    Args:
        batch_size: sequences decoded together.
        num_kv_heads: key/value heads of the attention layer.
        head_dim: features per head.
        max_seq_len: longest prompt plus generation.
        dtype: cache dtype (the model's compute dtype).
        device: where the cache lives.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def max_seq_len(self) -> int:
        return self.k_cache.shape[2]

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` (``[b, n_kv, s, h_d]``) at positions ``input_pos`` (``[s]``); return the full caches."""
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache
