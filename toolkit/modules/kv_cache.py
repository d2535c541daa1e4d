"""A static key/value cache for incremental decoding."""

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of past positions, written in place at ``input_pos``.

    Args:
        batch_size: sequences decoded together.
        num_kv_heads: key/value heads of the attention layer; None: those of the first keys stored (under tensor
            parallelism a layer computes only its rank's share of the heads, which its projections' shapes say).
        head_dim: features per head.
        max_seq_len: longest prompt plus generation.
        dtype: cache dtype (the model's compute dtype).
        device: where the cache lives.
    """

    def __init__(
        self,
        *,
        batch_size: int,
        num_kv_heads: int | None,
        head_dim: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self._shape = (batch_size, max_seq_len, head_dim)
        self._dtype, self._device = dtype, device
        self.register_buffer("k_cache", None, persistent=False)  # allocated in _allocate
        self.register_buffer("v_cache", None, persistent=False)
        if num_kv_heads is not None:
            self._allocate(num_kv_heads)

    def _allocate(self, num_kv_heads: int) -> None:
        batch_size, max_seq_len, head_dim = self._shape
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=self._dtype, device=self._device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=self._dtype, device=self._device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` (``[b, n_kv, s, h_d]``) at positions ``input_pos``: ``[s]``, the same slots in every row, or
        ``[b, s]``, each row its own (rows of a batch decoded together from prompts of different lengths); return the
        full caches."""
        if self.k_cache is None:
            self._allocate(k.shape[1])
        if input_pos.dim() == 2:
            rows = torch.arange(k.shape[0], device=input_pos.device)[:, None].expand_as(input_pos)
            # (Advanced indices around a slice put their dimensions first: [b, s, n_kv, h_d].)
            self.k_cache[rows, :, input_pos] = k.transpose(1, 2)
            self.v_cache[rows, :, input_pos] = v.transpose(1, 2)
        else:
            self.k_cache[:, :, input_pos] = k
            self.v_cache[:, :, input_pos] = v
        return self.k_cache, self.v_cache
