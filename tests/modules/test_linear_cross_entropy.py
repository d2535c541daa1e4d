"""linear_cross_entropy_sum and the decoder's ``labels=`` path: the projection and the loss together, chunk by chunk,
with the gradients computed in forward, against a float64 reference and against autograd's own path."""

import copy

import pytest
import torch
import torch.nn.functional as F

from toolkit.data import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.models.gemma2 import gemma2
from toolkit.models.llama3 import llama3, lora_llama3
from toolkit.modules import transformer
from toolkit.modules.loss import (
    LoRAAdapter,
    chunked_cross_entropy_sum,
    cross_entropy_sum,
    linear_cross_entropy_sum,
    logit_loss_and_grad,
)
from toolkit.modules.peft import LoRALinear, disable_adapters

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


def test_peaked_logits_of_a_trained_model_match_float64():
    # Logits hundreds apart, as a trained model's are over a large vocabulary: most log-probabilities are far below
    # float32's exp range, so their softmax underflows to zero. The gradient is taken by the softmax kernel (not as
    # the exp of the log-softmax, which is slow on CPU there), and must still match float64 to rounding.
    h, weight, labels = inputs(torch.float32)
    with torch.no_grad():
        h.mul_(30)
    assert float((h @ weight.T).std()) > 100
    loss, grad_h, grad_weight = fused(h, weight, labels, None, 3)
    expected_loss, expected_h, expected_weight = reference(h, weight, labels, None)
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert relative_error(grad_h, expected_h) < 5e-6
    assert relative_error(grad_weight, expected_weight) < 5e-6


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


# --- A LoRA output layer -----------------------------------------------------------------------------------------


def lora_inputs(*, separate_input: bool, trained_weight: bool = False, seed: int = 1):
    """``inputs()`` in float32 with a LoRA adapter of rank 4 (``B`` random, so it moves the logits) whose input is
    ``h`` itself or (``separate_input``, as after dropout) a tensor of its own."""
    h, weight, labels = inputs(torch.float32)
    weight.requires_grad_(trained_weight)
    generator = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(4, WIDTH, generator=generator).requires_grad_()
    lora_b = torch.randn(VOCAB, 4, generator=generator).mul(0.5).requires_grad_()
    x = torch.randn(h.shape, generator=generator).requires_grad_() if separate_input else h
    return h, weight, labels, LoRAAdapter(lora_a=lora_a, lora_b=lora_b, scale=0.75, x=x)


def lora_reference(h, weight, labels, adapter):
    """Loss and the gradients of h, weight, x, A, B by float64 autograd through whole logits."""
    leaves = [t.detach().double().requires_grad_() for t in (h, weight, adapter.x, adapter.lora_a, adapter.lora_b)]
    h64, weight64, x64, a64, b64 = leaves
    x64 = h64 if adapter.x is h else x64
    loss = cross_entropy_sum(h64 @ weight64.T + adapter.scale * (x64 @ a64.T) @ b64.T, labels)
    (loss * 0.3).backward()
    return loss, [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("separate_input", [False, True], ids=["x is h", "x apart (dropout)"])
@pytest.mark.parametrize("num_chunks", [1, 3, 100])  # 100: more chunks than kept positions (some empty)
def test_lora_adapter_float32_matches_float64_autograd(num_chunks, separate_input):
    h, weight, labels, adapter = lora_inputs(separate_input=separate_input, trained_weight=True)
    loss = linear_cross_entropy_sum(h, weight, labels, adapter=adapter, num_chunks=num_chunks)
    (loss * 0.3).backward()
    expected_loss, expected = lora_reference(h, weight, labels, adapter)
    # As test_float32_matches_float64_autograd: float32 rounding of sums over 50 logits and ~60 positions, plus
    # rank-4 matmuls; measured errors are below 6e-7.
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    grads = [h.grad, weight.grad, adapter.x.grad, adapter.lora_a.grad, adapter.lora_b.grad]
    if not separate_input:  # x is h: one gradient, both paths summed into it (the reference's x leaf is unused)
        grads[2] = expected[2] = None
    for name, grad, want in zip(["h", "weight", "x", "A", "B"], grads, expected):
        if want is not None:
            assert relative_error(grad, want) < 5e-6, name
    assert torch.count_nonzero(h.grad[labels == IGNORE]) == 0
    if separate_input:
        assert torch.count_nonzero(adapter.x.grad[labels == IGNORE]) == 0


def test_lora_adapter_without_gradients_and_under_autocast():
    h, weight, labels, adapter = lora_inputs(separate_input=True)
    expected_loss, expected = lora_reference(h, weight, labels, adapter)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h, weight, labels, adapter=adapter, num_chunks=3)
    assert not loss.requires_grad and float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    # float32 tensors under bfloat16 autocast: float32 gradients, as accurate (against float64) as the unfused
    # layer's arithmetic under autocast (F.linear in bfloat16; measured: at most 1.4x its error, which is 0.2-1.7%).
    trained = (h, adapter.x, adapter.lora_a, adapter.lora_b)

    def under_autocast(loss_fn):
        for t in trained:
            t.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn()
        (loss * 0.3).backward()
        return [loss, *(t.grad for t in trained)]

    ours = under_autocast(lambda: linear_cross_entropy_sum(h, weight, labels, adapter=adapter, num_chunks=2))
    assert all(t.grad.dtype == torch.float32 for t in trained) and weight.grad is None

    def unfused():
        lora = F.linear(F.linear(adapter.x, adapter.lora_a), adapter.lora_b)
        return cross_entropy_sum(F.linear(h, weight) + adapter.scale * lora, labels)

    theirs = under_autocast(unfused)
    truths = [expected_loss, expected[0], *expected[2:]]
    for mine, plain, truth in zip(ours, theirs, truths):
        assert relative_error(mine, truth) <= 2 * relative_error(plain, truth) + 1e-4


LORA_DIMS = dict(vocab_size=96, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                 max_seq_len=64, lora_attn_modules=["q_proj"], apply_lora_to_output=True, lora_rank=4, lora_alpha=8)


def _lora_model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    model = lora_llama3(**LORA_DIMS | overrides)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_b.weight"):  # B starts at zero: give the adapters something to add
                param.normal_(0, 0.3)
    return model


def _tokens_and_labels():
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(3))
    labels = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(4))
    labels[0, :7] = IGNORE
    labels[1, -2:] = IGNORE
    return tokens, labels


def _loss_and_grads(model, tokens, labels, seed=None, **kwargs):
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    loss = model(tokens, labels=labels, **kwargs) if kwargs else cross_entropy_sum(model(tokens), labels)
    loss.backward()
    return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def chunked_calls(monkeypatch) -> list[int]:
    """Counts the decoder's calls of the chunked-logits loss (each still computes it)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return chunked_cross_entropy_sum(*args, **kwargs)

    monkeypatch.setattr(transformer, "chunked_cross_entropy_sum", counted)
    return calls


@pytest.mark.parametrize("num_chunks", [None, 3, 100])
def test_lora_output_takes_the_fused_path_and_matches_float64(num_chunks, chunked_calls):
    model = _lora_model()
    assert model.fused_loss_weight() is model.output.weight
    tokens, labels = _tokens_and_labels()
    loss, grads = _loss_and_grads(model, tokens, labels, num_output_chunks=num_chunks)
    assert not chunked_calls
    assert {"output.lora_a.weight", "output.lora_b.weight"} <= grads.keys() and "output.weight" not in grads
    expected_loss, expected = _loss_and_grads(copy.deepcopy(model).double(), tokens, labels)  # whole logits
    assert grads.keys() == expected.keys()
    # float32 rounding through a one-layer model against float64: measured below 1e-7 (the loss) and 5e-7 (every
    # gradient, relative to its largest entry); held to the bounds of the function's own test.
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    for name, grad in grads.items():
        assert relative_error(grad, expected[name]) < 5e-6, name


def test_lora_output_with_dropout_draws_the_unfused_mask(chunked_calls):
    # The fused path applies the adapter's dropout once over the whole h, as LoRALinear.forward does on the unfused
    # path in one chunk: with the same seed, the same mask, so the same loss and gradients to float32 rounding.
    model = _lora_model(lora_dropout=0.5).train()
    tokens, labels = _tokens_and_labels()
    loss, grads = _loss_and_grads(model, tokens, labels, seed=7, num_output_chunks=3)
    assert not chunked_calls
    expected_loss, expected = _loss_and_grads(model, tokens, labels, seed=7, fused_loss=False)
    other_seed, _ = _loss_and_grads(model, tokens, labels, seed=8, fused_loss=False)
    assert len(chunked_calls) == 2
    assert float(other_seed) != pytest.approx(float(expected_loss), rel=1e-4)  # dropout does change the loss
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_lora_output_labels_path_matches_the_unfused_one(chunked_calls):
    model = _lora_model(lora_attn_modules=["q_proj", "v_proj"], apply_lora_to_mlp=True)
    tokens, labels = _tokens_and_labels()
    loss, grads = _loss_and_grads(model, tokens, labels, num_output_chunks=4)
    assert not chunked_calls
    expected_loss, expected = _loss_and_grads(model, tokens, labels, num_output_chunks=4, fused_loss=False)
    assert chunked_calls == [1]
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_disabled_lora_output_projects_with_its_base_fused(chunked_calls):
    model = _lora_model()
    tokens, labels = _tokens_and_labels()
    with disable_adapters(model):
        assert model.fused_loss_weight() is model.output.weight
        loss, grads = _loss_and_grads(model, tokens, labels, num_output_chunks=2)
        assert not chunked_calls
        expected_loss, expected = _loss_and_grads(model, tokens, labels, fused_loss=False)
    assert "output.lora_a.weight" not in grads and "output.lora_b.weight" not in grads
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("layer", ["dora", "nf4 base", "bias"])
def test_other_adapted_output_layers_take_the_chunked_logits_path(layer, chunked_calls):
    if layer == "bias":
        model = _lora_model()
        model.output = LoRALinear(32, 96, rank=4, alpha=8, use_bias=True)
    else:
        model = _lora_model(**{"dora": dict(use_dora=True), "nf4 base": dict(quantize_base=True)}[layer])
    assert model.fused_loss_weight() is None
    tokens, labels = _tokens_and_labels()
    loss = model(tokens, labels=labels, num_output_chunks=2)
    assert chunked_calls == [1]
    expected = chunked_cross_entropy_sum(model(tokens, num_output_chunks=2), labels)
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
