"""Attention and rotary embeddings against float64 references written from the papers' definitions."""

import math

import pytest
import torch
from torch import nn

from toolkit.modules import GroupedQueryAttention, Llama3RopeScaling, RotaryPositionalEmbeddings

# fp32 kernels vs a float64 reference: differences come from float32 rounding only (~1e-7 relative per op,
# accumulated over a few dozen-term dot products), so 1e-5 absolute on O(1) values leaves a wide margin.
ATOL = 1e-5


def reference_rope(x: torch.Tensor, base: float, inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate each feature pair (i, i + d/2) of x [b, h, s, d] by angle pos * theta_i, one pair at a time."""
    x = x.double()
    _, _, s, d = x.shape
    if inv_freq is None:
        inv_freq = torch.tensor([base ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    out = torch.empty_like(x)
    for pos in range(s):
        for i in range(d // 2):
            angle = pos * inv_freq[i].item()
            c, sn = math.cos(angle), math.sin(angle)
            a, b = x[..., pos, i], x[..., pos, i + d // 2]
            out[..., pos, i] = a * c - b * sn
            out[..., pos, i + d // 2] = a * sn + b * c
    return out


def reference_llama31_inv_freq(d: int, base: float, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaling applied frequency by frequency, as the release describes it."""
    freqs = []
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    for i in range(d // 2):
        freq = base ** (-2 * i / d)
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            freqs.append(freq)
        elif wavelen > low_wavelen:
            freqs.append(freq / scaling.factor)
        else:
            smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            freqs.append((1 - smooth) * freq / scaling.factor + smooth * freq)
    return torch.tensor(freqs, dtype=torch.float64)


def test_rope_matches_pairwise_rotation():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 16)
    rope = RotaryPositionalEmbeddings(16, max_seq_len=32, base=10_000.0)
    torch.testing.assert_close(rope(x).double(), reference_rope(x, 10_000.0), atol=ATOL, rtol=0)


def test_rope_with_llama31_scaling_matches_reference():
    torch.manual_seed(0)
    scaling = Llama3RopeScaling(factor=8.0, original_max_position_embeddings=64)
    # head_dim 64 with base 500k spans wavelengths below, inside and above the [16, 64] band.
    x = torch.randn(1, 2, 5, 64)
    rope = RotaryPositionalEmbeddings(64, max_seq_len=16, base=500_000.0, scaling=scaling)
    inv_freq = reference_llama31_inv_freq(64, 500_000.0, scaling)
    assert (inv_freq < torch.tensor([500_000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)).any()
    torch.testing.assert_close(rope(x).double(), reference_rope(x, 500_000.0, inv_freq), atol=ATOL, rtol=0)


def test_rope_explicit_positions_match_offsets():
    torch.manual_seed(0)
    rope = RotaryPositionalEmbeddings(8, max_seq_len=32)
    x = torch.randn(1, 2, 10, 8)
    full = rope(x)
    part = rope(x[:, :, 4:], torch.arange(4, 10))
    torch.testing.assert_close(part, full[:, :, 4:])


def reference_attention(x, wq, wk, wv, wo, num_heads, num_kv_heads, base, mask=None):
    """Naive float64 grouped-query attention: explicit head repetition, softmax over a causal score matrix."""
    x = x.double()
    b, s, _ = x.shape
    head_dim = wq.shape[0] // num_heads
    q = (x @ wq.double().T).view(b, s, num_heads, head_dim).transpose(1, 2)
    k = (x @ wk.double().T).view(b, s, num_kv_heads, head_dim).transpose(1, 2)
    v = (x @ wv.double().T).view(b, s, num_kv_heads, head_dim).transpose(1, 2)
    q, k = reference_rope(q, base), reference_rope(k, base)
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if mask is None else mask[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1) @ v
    return out.transpose(1, 2).reshape(b, s, -1) @ wo.double().T


def _attention(num_heads: int, num_kv_heads: int, dim: int = 32) -> GroupedQueryAttention:
    head_dim = dim // num_heads
    return GroupedQueryAttention(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        q_proj=nn.Linear(dim, num_heads * head_dim, bias=False),
        k_proj=nn.Linear(dim, num_kv_heads * head_dim, bias=False),
        v_proj=nn.Linear(dim, num_kv_heads * head_dim, bias=False),
        o_proj=nn.Linear(num_heads * head_dim, dim, bias=False),
        pos_embeddings=RotaryPositionalEmbeddings(head_dim, max_seq_len=64),
    )


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_attention_matches_float64_reference(num_heads, num_kv_heads):
    torch.manual_seed(0)
    attn = _attention(num_heads, num_kv_heads)
    x = torch.randn(2, 9, 32)
    expected = reference_attention(
        x, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
        num_heads, num_kv_heads, 10_000.0,
    )
    torch.testing.assert_close(attn(x).double(), expected, atol=ATOL, rtol=0)


def test_attention_with_explicit_mask_matches_reference():
    torch.manual_seed(0)
    attn = _attention(4, 2)
    x = torch.randn(2, 6, 32)
    # Two documents per row: block-diagonal causal mask.
    doc = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = (doc[:, None] == doc[None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    mask = mask.expand(2, 6, 6)
    expected = reference_attention(
        x, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight, 4, 2, 10_000.0, mask
    )
    torch.testing.assert_close(attn(x, mask=mask).double(), expected, atol=ATOL, rtol=0)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for backward while ``fn()`` runs forward."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


def test_explicit_positions_are_gathered_once_for_every_layer_that_shares_the_rotation():
    # Packed rows and context-parallel chunks give positions; each layer's rotation keeps cos and sin for backward.
    # Gathered per call, that was 4 [b, s, h_d] float32 copies per layer; now one pair for the whole model, while
    # the positions tensor lives, and the output is the same.
    from toolkit.models.llama3 import llama3

    torch.manual_seed(0)
    model = llama3(vocab_size=64, num_layers=4, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                   max_seq_len=512)
    b, s, head_dim = 2, 256, 16
    tokens = torch.randint(0, 64, (b, s))
    positions = torch.arange(s).repeat(b, 1)  # the same angles as no positions: only the storage differs
    plain = _saved_bytes(lambda: model(tokens))
    given = _saved_bytes(lambda: model(tokens, input_pos=positions))
    gathered_pair = 2 * b * s * head_dim * 4
    assert given - plain <= gathered_pair + positions.nbytes, (given - plain, gathered_pair)
    torch.testing.assert_close(model(tokens, input_pos=positions), model(tokens), rtol=0, atol=0)
    # A new positions tensor (or one changed in place) is gathered anew.
    rope = model.layers[0].self_attn.pos_embeddings
    shifted = positions.clone()
    shifted[:, 128:] -= 128  # two documents a row
    x = torch.randn(b, 4, s, head_dim)
    fresh = RotaryPositionalEmbeddings(head_dim, max_seq_len=512, base=rope.base)
    torch.testing.assert_close(rope(x, shifted), fresh(x, shifted), rtol=0, atol=0)
    shifted[:, 128:] += 128
    torch.testing.assert_close(rope(x, shifted), fresh(x, positions), rtol=0, atol=0)
