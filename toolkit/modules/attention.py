"""Grouped-query attention (Ainslie et al., 2023, https://arxiv.org/abs/2305.13245) on PyTorch's SDPA, or on
FlexAttention (https://pytorch.org/blog/flexattention/) for packed documents, sliding windows and soft-capping."""

import functools
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from toolkit.modules.masks import document_attention_mask
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
        self._flex_score_mod = None if logit_softcap is None else _softcap_score_mod(logit_softcap)
        self.kv_cache: KVCache | None = None

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | BlockMask | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend over ``x`` (``[b, s, d]``).

        Args:
            x: input hidden states.
            mask: boolean ``[b, s, s_kv]`` or ``[s, s_kv]``, True where attention is allowed; ``None`` means
                causal (or, with a KV cache, causal over the cached positions). A FlexAttention ``BlockMask``
                (from :class:`DocumentMasks`, this layer's sliding window already in it) computes the attention
                with ``flex_attention`` instead of SDPA; not with a KV cache.
            input_pos: positions of ``x``'s tokens (``[s]`` or ``[b, s]``); required with a KV cache, where they are
                also the cache slots written (per row with ``[b, s]``).
        """
        b, s, _ = x.shape
        # The head counts are the projections' output widths over head_dim, not num_heads: under tensor
        # parallelism each rank's projections give only its share of the heads (toolkit.parallel.apply_tp).
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, n_h, s, h_d]
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)  # [b, n_kv, s, h_d]
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos)
            k = self.pos_embeddings(k, input_pos)

        if isinstance(mask, SplitSequenceAttention):  # context parallelism: the sequence is split over ranks
            if self.kv_cache is not None:
                raise ValueError("attention over a split sequence is for training and scoring, not for a KV cache")
            return self.o_proj(_attend_split(mask, self, q, k, v).transpose(1, 2).reshape(b, s, -1))
        if self.kv_cache is not None:
            if isinstance(mask, BlockMask):
                raise ValueError("a FlexAttention block mask is for training and scoring, not for a KV cache")
            if input_pos is None:
                raise ValueError("attention with a KV cache needs input_pos")
            k, v = self.kv_cache.update(input_pos, k, v)
            if mask is None:
                # Query at position p sees cached positions 0..p; later slots hold zeros or stale values.
                cache_pos = torch.arange(self.kv_cache.max_seq_len, device=x.device)
                mask = cache_pos <= input_pos[..., None]  # [s, max_seq_len], or [b, s, max_seq_len] per row
        out = self.attend(q, k, v, mask=mask, input_pos=input_pos)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        mask: torch.Tensor | BlockMask | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This layer's attention of queries ``[b, n_h, s, h_d]`` over keys and values ``[b, n_kv, s_kv, h_d]``
        (rotated, normed, from the cache where there is one), ``mask`` and ``input_pos`` as in :meth:`forward`;
        returns ``[b, n_h, s, h_d]``. Its sliding window and soft-cap are applied here."""
        grouped = k.shape[1] != q.shape[1]
        if isinstance(mask, BlockMask):
            return _flex_attention(q.device)(
                q, k, v, score_mod=self._flex_score_mod, block_mask=mask, scale=self.softmax_scale, enable_gqa=grouped,
            )
        is_causal = mask is None and self.kv_cache is None
        if self.sliding_window is not None or (self.logit_softcap is not None and mask is None):
            mask = self._restrict_mask(mask, input_pos, q.shape[2], q.device)
            is_causal = False
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]  # [b, 1, s, s_kv]: the same mask for every head
        if self.logit_softcap is None:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.softmax_scale, enable_gqa=grouped,
            )
        return self._softcapped_attention(q, k, v, mask)

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
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # [b, n_h, s_kv, h_d]
        v = v.repeat_interleave(groups, dim=1)
        scale = self.softmax_scale if self.softmax_scale is not None else self.head_dim**-0.5
        scores = (q @ k.transpose(-2, -1)) * scale  # [b, n_h, s, s_kv]
        scores = torch.tanh(scores / self.logit_softcap) * self.logit_softcap
        scores = scores.masked_fill(~mask, float("-inf"))
        # The softmax runs in float32 whatever the compute dtype, as in Gemma 2's reference code.
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v  # [b, n_h, s, h_d]


class SplitSequenceAttention:
    """Attention over a sequence split across processes (context parallelism), given as the layer's ``mask``.

    The layer computes its projections, norms and rotary embedding on its own positions as always, then hands the
    queries, keys and values to :meth:`attend`, which exchanges what it needs with the other processes holding the
    row and returns this layer's attention output for the local positions. Implementations live in
    :mod:`toolkit.parallel.context_parallel`; modules never import them.
    """

    def attend(
        self, layer: "GroupedQueryAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """``[b, n_h, s, h_d]`` attention outputs for the local queries ``q`` and keys/values ``k``, ``v``."""
        raise NotImplementedError


@torch.compiler.disable
def _attend_split(split: SplitSequenceAttention, layer: "GroupedQueryAttention", q, k, v) -> torch.Tensor:
    """``split.attend`` run eagerly inside a compiled layer: the exchanges between processes (all-to-all, the ring's
    sends and receives, and their autograd functions) are not traced, so a compiled layer breaks its graph here and
    compiles the projections, norms and MLP around it."""
    return split.attend(layer, q, k, v)


# tl.dot in FlexAttention's Triton kernels needs at least 16 features per head (PyTorch raises otherwise).
FLEX_MIN_HEAD_DIM = 16


class DocumentMasks:
    """Causal attention within each row's documents, as FlexAttention block masks, one per sliding window.

    A packed row holds several documents, and a token may attend only to itself and earlier tokens of its own
    document. SDPA can take that only as a dense ``[b, s, s]`` mask, which rules out its flash kernel and computes
    every block of scores, masked or not; ``flex_attention`` takes a block mask and skips the blocks that are masked
    whole. It also applies Gemma 2's score soft-cap inside the kernel, where SDPA cannot, so those layers need not
    materialize their scores.

    Pass it as the decoder's ``mask``: :class:`~toolkit.modules.TransformerDecoder` asks it for each layer's mask
    with :meth:`for_layer`. A block mask is built on first use, for each sliding window the layers have, and
    shared by every layer with that window. Rows without documents (``document_ids=None``) in a layer with neither
    window nor soft-cap get ``None``: SDPA's causal (flash) kernel, which is faster than FlexAttention there.

    FlexAttention runs compiled on CUDA (``torch.compile(flex_attention)``). On CPU PyTorch runs it unfused and
    has no backward for it, so it serves there only for scoring without gradients (and for tests).

    Args:
        document_ids: ``[b, s]`` the document of each position (0, 1, ... within a row; see
            :func:`toolkit.data.packing.document_ids`), or ``None``: every row is one document.
        seq_len: positions per row.
        device: where the block masks live (that of the activations).
    """

    def __init__(self, document_ids: torch.Tensor | None, *, seq_len: int, device: torch.device) -> None:
        if document_ids is not None and document_ids.shape[-1] != seq_len:
            raise ValueError(f"document_ids cover {document_ids.shape[-1]} positions, not seq_len={seq_len}")
        self.document_ids = document_ids
        self.seq_len = seq_len
        self.device = torch.device(device)
        self._block_masks: dict[int | None, BlockMask] = {}
        self._dense: torch.Tensor | None = None

    def for_layer(self, attention: "GroupedQueryAttention") -> BlockMask | torch.Tensor | None:
        """The mask for a layer whose attention is ``attention``: a block mask, or ``None`` for plain causal.

        Heads narrower than FlexAttention's GPU kernels take (16 features) get SDPA's masks instead: ``None``
        without documents, else the dense ``[b, s, s]`` mask of the documents (the layer adds its window).
        """
        if self.document_ids is None and attention.sliding_window is None and attention.logit_softcap is None:
            return None
        if attention.head_dim < FLEX_MIN_HEAD_DIM:
            return None if self.document_ids is None else self.dense()
        return self.block_mask(attention.sliding_window)

    def dense(self) -> torch.Tensor:
        """The boolean ``[b, s, s]`` mask of the documents, True where attention is allowed (built once)."""
        if self._dense is None:
            self._dense = document_attention_mask(self.document_ids)
        return self._dense

    def block_mask(self, sliding_window: int | None = None) -> BlockMask:
        """The block mask: causal, within a document, and within ``sliding_window`` positions (itself included)."""
        if sliding_window not in self._block_masks:
            batch = None if self.document_ids is None else self.document_ids.shape[0]
            self._block_masks[sliding_window] = create_block_mask(
                self._mask_mod(sliding_window), batch, None, self.seq_len, self.seq_len, device=self.device
            )
        return self._block_masks[sliding_window]

    def _mask_mod(self, sliding_window: int | None) -> Callable:
        docs = self.document_ids

        def allowed(b, h, q_idx, kv_idx):
            keep = kv_idx <= q_idx
            if docs is not None:
                keep = keep & (docs[b, q_idx] == docs[b, kv_idx])
            if sliding_window is not None:
                keep = keep & (q_idx - kv_idx < sliding_window)
            return keep

        return allowed


def _softcap_score_mod(cap: float) -> Callable:
    """Gemma 2's soft-cap as a FlexAttention score modification: ``cap * tanh(score / cap)`` on the scaled scores."""

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return softcap


@functools.cache
def _compiled_flex_attention() -> Callable:
    # Compiled once per process and shape: fused kernels that skip masked blocks (uncompiled, FlexAttention
    # materializes every score). A static shape: packed rows all have the pack's length.
    return torch.compile(flex_attention, dynamic=False)


def _flex_attention(device: torch.device) -> Callable:
    if torch.compiler.is_compiling():
        return flex_attention  # inside a compiled layer: traced into its graph and fused there
    if device.type != "cpu":
        return _compiled_flex_attention()

    def unfused(*args, **kwargs):  # CPU: scoring without gradients and tests; speed is not the point there
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(*args, **kwargs)

    return unfused
