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
        sliding_window: if set, a query attends only to the last ``sliding_window`` positions, itself included
            (Mistral v0.1, Gemma 2's local layers; Beltagy et al., 2020, https://arxiv.org/abs/2004.05150).
        logit_softcap: if set, attention scores become ``cap * tanh(scores / cap)`` before the softmax (Gemma 2).
            SDPA cannot apply it, so these layers compute attention explicitly.
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
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
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
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
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
        if self.sliding_window is not None or (self.logit_softcap is not None and mask is None):
            mask = self._restrict_mask(mask, input_pos, s, x.device)
            is_causal = False
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [b, 1, s, s_kv]: the same mask for every head

        if self.logit_softcap is None:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )  # [b, n_h, s, h_d]
        else:
            out = self._softcapped_attention(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))

    def _restrict_mask(
        self, mask: torch.Tensor | None, input_pos: torch.Tensor | None, seq_len: int, device: torch.device
    ) -> torch.Tensor:
        # An explicit mask for the paths SDPA's is_causal cannot express: causal where none is given, then the
        # sliding-window band. Keys are the cache slots with a cache, else the queries' own positions.
        q_pos = input_pos if input_pos is not None else torch.arange(seq_len, device=device)
        k_pos = torch.arange(self.kv_cache.max_seq_len, device=device) if self.kv_cache is not None else q_pos
        distance = q_pos[..., :, None] - k_pos[..., None, :]  # [s, s_kv] or [b, s, s_kv]
        if mask is None:
            mask = distance >= 0
        if self.sliding_window is not None:
            mask = mask & (distance < self.sliding_window)
        return mask

    def _softcapped_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # [b, n_h, s_kv, h_d]
        v = v.repeat_interleave(groups, dim=1)
        scale = self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5
        scores = (q @ k.transpose(-2, -1)) * scale  # [b, n_h, s, s_kv]
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        # The softmax runs in float32 whatever the compute dtype, as in Gemma 2's reference code.
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v  # [b, n_h, s, h_d]
