"""sdpa_preference (config ``sdpa_backend``): SDPA tries the named backend first and falls back as before; the
order is restored after. On a GPU: cuDNN serves our grouped-query layers and matches the flash kernel."""

import pytest
import torch

from tests.launch import run_recipe_here, run_tune
from toolkit.errors import UserError
from toolkit.modules import GroupedQueryAttention, RotaryPositionalEmbeddings
from toolkit.training import sdpa_preference
from toolkit.training.attention_backend import SDPA_BACKENDS


@pytest.mark.parametrize("name", list(SDPA_BACKENDS))
def test_the_named_backend_goes_first_and_the_order_comes_back(name):
    before = torch._C._get_sdp_priority_order()
    with sdpa_preference(name):
        order = torch._C._get_sdp_priority_order()
        assert order[0] == int(SDPA_BACKENDS[name])
        # Every backend stays enabled: a preference, not a restriction.
        assert sorted(order[:4]) == sorted(int(b) for b in SDPA_BACKENDS.values())
        assert torch._C._get_flash_sdp_enabled() and torch._C._get_cudnn_sdp_enabled()
    assert torch._C._get_sdp_priority_order() == before


@pytest.mark.parametrize("setting", [None, "default"])
def test_default_leaves_pytorchs_order(setting):
    before = torch._C._get_sdp_priority_order()
    with sdpa_preference(setting):
        assert torch._C._get_sdp_priority_order() == before


def test_an_unknown_backend_is_a_user_error():
    with pytest.raises(UserError, match=r"sdpa_backend: expected default, flash, efficient, math, cudnn; got 'cudann'"):
        with sdpa_preference("cudann"):
            pass


def layer(device: torch.device, dtype: torch.dtype, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128):
    """An attention layer in Llama 3.1 8B's layout by default (grouped queries), random weights."""
    torch.manual_seed(0)
    d, linear = heads * head_dim, torch.nn.Linear
    return GroupedQueryAttention(
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        q_proj=linear(d, heads * head_dim, bias=False), k_proj=linear(d, kv_heads * head_dim, bias=False),
        v_proj=linear(d, kv_heads * head_dim, bias=False), o_proj=linear(heads * head_dim, d, bias=False),
        pos_embeddings=RotaryPositionalEmbeddings(head_dim, max_seq_len=4096, base=500_000.0),
    ).to(device=device, dtype=dtype)


def forward_backward(attn: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    attn.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = attn(x)
    out.float().square().mean().backward()
    return out.detach(), [x.grad, *(p.grad for p in attn.parameters())]


@pytest.mark.parametrize("name", list(SDPA_BACKENDS))
def test_on_cpu_every_preference_computes_the_same_attention(name):
    # On the CPU cuDNN serves nothing and falls back; the others are CPU kernels of the same math (float32).
    attn = layer(torch.device("cpu"), torch.float32, heads=4, kv_heads=2, head_dim=16)
    x = torch.randn(2, 32, 64)
    expected, expected_grads = forward_backward(attn, x)
    with sdpa_preference(name):
        out, grads = forward_backward(attn, x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for grad, reference in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, reference, rtol=1e-4, atol=1e-6)


def test_the_recipe_takes_the_setting_and_refuses_a_typo(tmp_path):
    overrides = ["max_steps=1", "progress_bar=false", "~eval_tasks"]
    run_recipe_here("full_finetune", "demo", *overrides, f"output_dir={tmp_path / 'ok'}", "sdpa_backend=cudnn")
    bad = run_tune("run", "full_finetune_single_device", "--config", "demo", *overrides,
                   f"output_dir={tmp_path / 'bad'}", "sdpa_backend=cudann")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1
    assert "sdpa_backend: expects one of default, flash, efficient, math, cudnn or null, got 'cudann'" in bad.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cudnn_serves_grouped_query_attention_and_matches_flash_on_cuda():
    # Llama 3.1 8B's layer, bf16, 2 x 2048 tokens. Held to cuDNN alone, SDPA must run (cuDNN serves these
    # grouped-query shapes, or the preference would change nothing); forward and backward agree with the default
    # (flash) kernel to bfloat16 rounding (both accumulate in float32; they order the sums differently).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attn = layer(torch.device("cuda"), torch.bfloat16)
    x = torch.randn(2, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    expected, expected_grads = forward_backward(attn, x)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out, grads = forward_backward(attn, x)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    for grad, reference in zip(grads, expected_grads, strict=True):
        scale = reference.float().abs().max()
        assert (grad.float() - reference.float()).abs().max() <= 2e-2 * scale
