"""Grouped-query attention (Ainslie et al., 2023, https://arxiv.org/abs/2305.13245) on PyTorch's SDPA."""

import torch
import torch.nn.functional as F
from torch import nn

from toolkit.modules.kv_cache import KVCache


class GroupedQueryAttention(nn.Module):
    """Multi-head attention where ``num_heads`` query heads share ``num_kv_heads`` key/value heads.

    The projections, position embedding and optional q/k norms are passed in (builders compose them), so LoRA
    or quantized projections drop in without touching this class.

    Args:
        num_heads: query heads.
        num_kv_heads: key/value heads (divides ``num_heads``; equal for plain multi-head attention).
        head_dim: features per head.
        q_proj, k_proj, v_proj, o_proj: the four projections.
        pos_embeddings: applied to queries and keys (rotary), or ``None``.
        q_norm, k_norm: per-head norms on queries and keys (Qwen3), or ``None``.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        o_proj: nn.Module,
        pos_embeddings: nn.Module | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        softmax_scale: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.o_proj = o_proj
        self.pos_embeddings = pos_embeddings
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.softmax_scale = softmax_scale
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` (``[b, s, d]``).

        Args:
            x: input hidden states.
            mask: boolean ``[b, s, s_kv]`` or ``[s, s_kv]``, True where attention is allowed; ``None`` means
                causal (or, with a KV cache, causal over the cached positions).
            input_pos: positions of ``x``'s tokens (``[s]`` or ``[b, s]``); required with a KV cache.
        """
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [b, n_h, s, h_d]
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, n_kv, s, h_d]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos)
            k = self.pos_embeddings(k, input_pos)

        is_causal = mask is None
        if self.kv_cache is not None:
            if input_pos is None:
                raise ValueError("attention with a KV cache needs input_pos")
            k, v = self.kv_cache.update(input_pos, k, v)
            if mask is None:
                # Query at position p sees cached positions 0..p; later slots hold zeros or stale values.
                cache_pos = torch.arange(self.kv_cache.max_seq_len, device=x.device)
                mask = cache_pos[None, :] <= input_pos.reshape(-1, 1)  # [s, max_seq_len]
            is_causal = False
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [b, 1, s, s_kv]: the same mask for every head

        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )  # [b, n_h, s, h_d]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
