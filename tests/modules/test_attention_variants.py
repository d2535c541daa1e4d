"""GroupedQueryAttention's optional sliding window and logit soft-capping against plain causal attention."""

import torch
from torch import nn

from toolkit.modules import GroupedQueryAttention, RotaryPositionalEmbeddings


def attention(**kwargs) -> GroupedQueryAttention:
    torch.manual_seed(0)
    return GroupedQueryAttention(
        num_heads=4, num_kv_heads=2, head_dim=8,
        q_proj=nn.Linear(16, 32), k_proj=nn.Linear(16, 16), v_proj=nn.Linear(16, 16), o_proj=nn.Linear(32, 16),
        pos_embeddings=RotaryPositionalEmbeddings(8, max_seq_len=32), **kwargs,
    )


def test_window_longer_than_the_sequence_and_huge_cap_change_nothing():
    x = torch.randn(2, 10, 16)
    expected = attention()(x)
    torch.testing.assert_close(attention(sliding_window=10)(x), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(attention(logit_softcap=1e6)(x), expected, atol=1e-6, rtol=0)


def test_window_matches_an_explicit_band_mask():
    x = torch.randn(2, 10, 16)
    i = torch.arange(10)
    band = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 3)
    torch.testing.assert_close(attention(sliding_window=3)(x), attention()(x, mask=band), atol=1e-6, rtol=0)


def test_softcap_matches_a_float64_reference():
    attn = attention(logit_softcap=0.5).double()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    q = attn.pos_embeddings(attn.q_proj(x).view(1, 6, 4, 8).transpose(1, 2))
    k = attn.pos_embeddings(attn.k_proj(x).view(1, 6, 2, 8).transpose(1, 2)).repeat_interleave(2, dim=1)
    v = attn.v_proj(x).view(1, 6, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = 0.5 * torch.tanh(q @ k.transpose(-1, -2) / 8**0.5 / 0.5)
    scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    expected = attn.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 32))
    # The softmax runs in float32 by design (Gemma 2 parity), hence the float32-level tolerance.
    torch.testing.assert_close(attn(x), expected, atol=1e-6, rtol=0)
