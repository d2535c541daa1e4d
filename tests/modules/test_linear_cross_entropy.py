"""linear_cross_entropy_sum and the decoder's ``labels=`` path: the projection and the loss together, chunk by chunk,
with the gradients computed in forward, against a float64 reference and against autograd's own path."""

import pytest
import torch
import torch.nn.functional as F

from toolkit.data import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.models.gemma2 import gemma2
from toolkit.models.llama3 import llama3, lora_llama3
from toolkit.modules.loss import (
    chunked_cross_entropy_sum,
    cross_entropy_sum,
    linear_cross_entropy_sum,
    logit_loss_and_grad,
)

IGNORE = CROSS_ENTROPY_IGNORE_INDEX
VOCAB, WIDTH = 50, 16


def inputs(dtype: torch.dtype, *, seq: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states ``[2, seq, d]``, an output weight, and labels with a prompt and padding ignored."""
    generator = torch.Generator().manual_seed(seed)
    h = torch.randn(2, seq, WIDTH, generator=generator).mul(2).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, WIDTH, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (2, seq), generator=generator)
    labels[0, :10] = IGNORE
    labels[1, -3:] = IGNORE
    return h, weight, labels


def reference(h, weight, labels, softcap, *, dtype=torch.float64):
    """Loss and gradients by autograd through whole logits, in ``dtype``."""
    h = h.detach().to(dtype).requires_grad_()
    weight = weight.detach().to(dtype).requires_grad_()
    logits = h @ weight.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = cross_entropy_sum(logits, labels)
    (loss * 0.3).backward()
    return loss, h.grad, weight.grad


def fused(h, weight, labels, softcap, num_chunks):
    h.grad = weight.grad = None
    loss = linear_cross_entropy_sum(h, weight, labels, num_chunks=num_chunks, softcap=softcap)
    (loss * 0.3).backward()  # a non-unit upstream gradient: backward must scale what forward computed
    return loss, h.grad, weight.grad


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max())


@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("num_chunks", [1, 3, 8, 100])  # 100: more chunks than kept positions (some empty)
def test_float32_matches_float64_autograd(num_chunks, softcap):
    h, weight, labels = inputs(torch.float32)
    loss, grad_h, grad_weight = fused(h, weight, labels, softcap, num_chunks)
    expected_loss, expected_h, expected_weight = reference(h, weight, labels, softcap)
    assert loss.dtype == torch.float32
    # float32 rounding of sums over 50 logits and ~60 positions: measured errors are below 1e-6.
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert relative_error(grad_h, expected_h) < 5e-6
    assert relative_error(grad_weight, expected_weight) < 5e-6
    assert torch.count_nonzero(grad_h[labels == IGNORE]) == 0  # ignored positions get no logits, no gradient


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_bfloat16_is_as_accurate_as_autograd_in_bfloat16(softcap):
    # Both round the matmuls' outputs and the logits' gradient to bfloat16; the fused path accumulates the weight's
    # gradient over chunks in bfloat16 as autograd does for a weight used once per chunk. Its error against float64
    # must be of the same size as autograd's own bfloat16 path (measured: at most 1.5x).
    h, weight, labels = inputs(torch.bfloat16)
    loss, grad_h, grad_weight = fused(h, weight, labels, softcap, 4)
    assert grad_h.dtype == grad_weight.dtype == torch.bfloat16
    exact = reference(h, weight, labels, softcap)
    plain = reference(h, weight, labels, softcap, dtype=torch.bfloat16)
    for ours, theirs, truth in zip((loss, grad_h, grad_weight), plain, exact):
        assert relative_error(ours, truth) <= 2 * relative_error(theirs, truth) + 1e-4


def test_frozen_weight_gets_no_gradient_and_the_hidden_states_do():
    h, weight, labels = inputs(torch.float32)
    weight = weight.detach()
    loss = linear_cross_entropy_sum(h, weight, labels, num_chunks=3)
    loss.backward()
    _, expected_h, _ = reference(h, weight, labels, None)
    assert weight.grad is None
    assert relative_error(h.grad * 0.3, expected_h) < 5e-6


def test_without_gradients_only_the_loss_is_computed():
    h, weight, labels = inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h, weight, labels, num_chunks=3)
    assert not loss.requires_grad
    assert float(loss) == pytest.approx(float(reference(h, weight, labels, None)[0]), rel=1e-6)


def test_all_ignored_gives_zero_loss_and_gradients():
    h, weight, _ = inputs(torch.float32)
    loss = linear_cross_entropy_sum(h, weight, torch.full((2, 37), IGNORE), num_chunks=4)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(weight.grad) == 0


def test_autocast_computes_in_its_dtype_and_returns_float32_gradients():
    # float32 weights under bfloat16 autocast, as a single-device mixed-precision run has them: the same loss and
    # gradients as F.linear under autocast followed by the float32 loss, to bfloat16 rounding.
    h, weight, labels = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy_sum(h, weight, labels, num_chunks=2)
    loss.backward()
    assert h.grad.dtype == weight.grad.dtype == torch.float32
    got = (loss, h.grad, weight.grad)
    h.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(h, weight)
    assert logits.dtype == torch.bfloat16
    expected = cross_entropy_sum(logits, labels)
    expected.backward()
    for ours, theirs in zip(got, (expected, h.grad, weight.grad)):
        assert relative_error(ours, theirs) < 2e-2  # a few bfloat16 ulps (2^-8 each)


def test_a_second_backward_is_refused():
    # The backward scales the saved gradients in place; a second one would scale them twice.
    h, weight, labels = inputs(torch.float32)
    loss = linear_cross_entropy_sum(h, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


# --- The decoder's labels= path -------------------------------------------------------------------------------------


def _models():
    dims = dict(vocab_size=96, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                max_seq_len=64)
    torch.manual_seed(0)
    yield "llama3", llama3(**dims)
    torch.manual_seed(0)
    yield "llama3 tied", llama3(**dims, tie_word_embeddings=True)
    torch.manual_seed(0)
    yield "gemma2 (soft-capped, tied, scaled embedding)", gemma2(
        **dims | dict(embed_dim=64), head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        final_logit_softcap=2.0,  # small enough that the cap bends these small random logits
    )


@pytest.mark.parametrize("name", ["llama3", "llama3 tied", "gemma2 (soft-capped, tied, scaled embedding)"])
@pytest.mark.parametrize("num_chunks", [None, 3])
def test_decoder_labels_path_equals_logits_then_loss(name, num_chunks):
    model = dict(_models())[name]
    assert model.fused_loss_weight() is not None
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    labels[0, :7] = IGNORE

    def loss_and_grads(**kwargs):
        model.zero_grad(set_to_none=True)
        loss = model(tokens, **kwargs) if "labels" in kwargs else cross_entropy_sum(model(tokens), labels)
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    expected_loss, expected = loss_and_grads()
    for fused_loss in (True, False):
        loss, grads = loss_and_grads(labels=labels, num_output_chunks=num_chunks, fused_loss=fused_loss)
        assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
        for param_name, grad in grads.items():
            torch.testing.assert_close(grad, expected[param_name], rtol=1e-4, atol=1e-6, msg=param_name)


def test_an_adapted_output_layer_takes_the_chunked_logits_path():
    torch.manual_seed(0)
    model = lora_llama3(vocab_size=96, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                        max_seq_len=64, lora_attn_modules=["q_proj"], apply_lora_to_output=True, lora_rank=4,
                        lora_alpha=8)
    assert model.fused_loss_weight() is None
    tokens = torch.randint(0, 96, (2, 12))
    loss = model(tokens, labels=tokens, num_output_chunks=2)
    expected = chunked_cross_entropy_sum(model(tokens, num_output_chunks=2), tokens)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


# --- On a GPU: the compiled kernel, its accuracy and its memory ---------------------------------------------------


def check_compiled_on(device: torch.device, *, tokens: int, vocab: int, width: int, num_chunks: int) -> dict:
    """bfloat16 hidden states and weight on ``device``, the kernel compiled as ``compile_model`` compiles it: loss
    and gradients against float64 autograd, within what autograd's own bfloat16 path reaches, and the memory the
    loss took against ``logits_bytes(fused=True)``'s chunk term. Returns what it measured (for a dry run on CPU)."""
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, width, generator=generator).to(device, torch.bfloat16).requires_grad_()
    weight = (torch.randn(vocab, width, generator=generator) / width**0.5).to(device, torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (1, tokens), generator=generator).to(device)
    labels[0, : tokens // 4] = IGNORE
    kernel = torch.compile(logit_loss_and_grad)
    linear_cross_entropy_sum(h, weight, labels, num_chunks=num_chunks, kernel=kernel).backward()  # compile first
    h.grad = weight.grad = None
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    loss = linear_cross_entropy_sum(h, weight, labels, num_chunks=num_chunks, kernel=kernel)
    (loss * 0.3).backward()
    peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
    exact = reference(h, weight, labels, None)
    plain = reference(h, weight, labels, None, dtype=torch.bfloat16)
    errors = [(relative_error(ours, truth), relative_error(theirs, truth))
              for ours, theirs, truth in zip((loss, h.grad, weight.grad), plain, exact)]
    kept = tokens - tokens // 4
    # One chunk's logits (2 bytes), their float32 upcast and log-softmax (4 + 4: eager's; the compiled kernel keeps
    # them in registers, so this bounds it); in bfloat16 the kept rows' copy and gradient, h's gradient and the
    # weight's; a MiB for the scalars.
    chunk = -(-kept // num_chunks) * vocab * (2 + 8)
    return dict(errors=errors, peak=peak, bound=chunk + ((2 * kept + tokens) * width + vocab * width) * 2 + 2**20)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_fused_loss_on_cuda_is_accurate_and_holds_one_chunk():
    # Llama 3's vocabulary and a 2048-wide model, 8192 positions (a quarter ignored) in 8 chunks: whole logits in
    # bfloat16 would be 2 GiB on their own; the loss must stay within one chunk's worth and the gradients.
    found = check_compiled_on(torch.device("cuda"), tokens=8192, vocab=128_256, width=2048, num_chunks=8)
    (loss, theirs_loss), (grad_h, theirs_h), (grad_weight, theirs_weight) = found["errors"]
    assert loss <= 2 * theirs_loss + 1e-4 and grad_h <= 2 * theirs_h + 1e-4, found
    # The weight's gradient is summed over the 8 chunks in bfloat16, as autograd sums it over chunked logits; the
    # reference takes it in one matmul. Eight roundings of partial sums against one: up to about sqrt(8) as large
    # (measured on CPU at 512 positions: 1.6x).
    assert grad_weight <= 4 * theirs_weight + 1e-4, found
    assert found["peak"] <= found["bound"], found
