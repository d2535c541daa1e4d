"""chunked_cross_entropy_sum: the unchunked loss and gradients, without ever holding the float32 logits."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from toolkit.data import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.models.llama3 import llama3
from toolkit.modules.loss import chunked_cross_entropy_sum, cross_entropy_sum

IGNORE = CROSS_ENTROPY_IGNORE_INDEX
DIMS = dict(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64, max_seq_len=64)


def labels_for(shape: tuple[int, int], vocab: int, seed: int = 2) -> torch.Tensor:
    """Random targets with ignored stretches: a prompt at the start of row 0, padding at the end of row 1."""
    labels = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    labels[0, : shape[1] // 2] = IGNORE
    labels[1, -3:] = IGNORE
    return labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_chunks", [1, 3, 5, 17, 24])
def test_equals_the_unchunked_loss_and_gradient_of_the_same_logits(num_chunks, dtype):
    logits = torch.randn(2, 17, 50, generator=torch.Generator().manual_seed(1)).mul(3).to(dtype).requires_grad_()
    labels = labels_for((2, 17), 50)
    expected = cross_entropy_sum(logits, labels)
    (expected_grad,) = torch.autograd.grad(expected * 0.3, logits)
    loss = chunked_cross_entropy_sum(list(logits.tensor_split(num_chunks, dim=1)), labels)
    (grad,) = torch.autograd.grad(loss * 0.3, logits)
    assert loss.dtype == torch.float32
    # Both compute in float32 from the same logits; only the order of the float32 sum differs.
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    # softmax - one_hot here against autograd's exp(log_softmax) - one_hot: float32 rounding, then the cast back.
    torch.testing.assert_close(grad, expected_grad, **({} if dtype == torch.float32 else dict(rtol=0, atol=2**-9)))
    assert torch.count_nonzero(grad[labels == IGNORE]) == 0


def test_all_ignored_gives_zero_loss_and_gradient():
    logits = torch.randn(2, 6, 10, requires_grad=True)
    labels = torch.full((2, 6), IGNORE)
    loss = chunked_cross_entropy_sum(list(logits.tensor_split(4, dim=1)), labels)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(logits.grad) == 0


def test_chunks_must_cover_the_labels():
    logits = torch.randn(2, 6, 10)
    with pytest.raises(ValueError, match=r"lengths \[3, 2\] do not cover labels of sequence length 6"):
        chunked_cross_entropy_sum([logits[:, :3], logits[:, 3:5]], torch.zeros(2, 6, dtype=torch.long))


def _loss_and_grads(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, num_chunks: int | None):
    model.zero_grad(set_to_none=True)
    if num_chunks is None:
        loss = cross_entropy_sum(model(tokens), labels)
    else:
        loss = chunked_cross_entropy_sum(model(tokens, num_output_chunks=num_chunks), labels)
    loss.backward()
    return loss.detach(), [p.grad.float() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("num_chunks", [1, 4, 7])
def test_model_gradients_equal_the_unchunked_path(num_chunks, tied, dtype):
    torch.manual_seed(0)
    model = llama3(vocab_size=96, **DIMS, tie_word_embeddings=tied).to(dtype)
    tokens = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(1))
    labels = labels_for((2, 19), 96)
    expected_loss, expected_grads = _loss_and_grads(model, tokens, labels, None)
    loss, grads = _loss_and_grads(model, tokens, labels, num_chunks)
    if dtype == torch.float32:
        torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
        for grad, expected in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    else:
        # bf16 logits and gradients: chunked and unchunked matmuls may round an element differently (one bf16
        # ulp, 2**-8 relative), which the summed loss and the gradients carry.
        torch.testing.assert_close(loss, expected_loss, rtol=2e-3, atol=0)
        for grad, expected in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def _allocations(fn) -> list[int]:
    """The CPU allocator's allocations (positive) and frees (negative) while ``fn`` runs, in order, in bytes.

    From the profiler's memory events (``profile_memory=True``); their order lives in the profiler's event tree,
    which ``torch.profiler``'s own memory timeline reads too.
    """
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    assert events, "the profiler recorded no allocation"
    return [size for _, size in sorted(events)]


def _peak(allocations: list[int]) -> int:
    live = peak = 0
    for size in allocations:
        live += size
        peak = max(peak, live)
    return peak


def test_the_float32_logits_are_never_allocated():
    """A bf16 model whose logits dominate its memory: training one micro-batch, the chunked path never allocates a
    tensor larger than one chunk's float32 logits, and its peak is below the size of the float32 logits alone."""
    vocab, batch_size, seq_len, num_chunks = 8192, 2, 256, 8
    torch.manual_seed(0)
    model = llama3(vocab_size=vocab, **dict(DIMS, num_layers=1, max_seq_len=seq_len), tie_word_embeddings=True)
    model = model.to(torch.bfloat16)
    tokens = torch.randint(0, vocab, (batch_size, seq_len))
    labels = labels_for((batch_size, seq_len), vocab)
    fp32_logits = batch_size * seq_len * vocab * 4  # 16 MiB
    # 2 MiB: 8 chunks, so that a chunk stays larger than the tied weight's gradient as a float32 matmul result (1 MiB
    # and a few kB of workspace on torch 2.13's CPU mm), which each chunk's backward allocates and which is not logits.
    fp32_chunk = fp32_logits // num_chunks

    def unchunked() -> None:
        cross_entropy_sum(model(tokens), labels).backward()

    def chunked() -> None:
        # The caller keeps no reference to the chunks, so each is freed once its gradient is computed.
        chunked_cross_entropy_sum(model(tokens, num_output_chunks=num_chunks), labels).backward()

    for step in (unchunked, chunked):
        step()  # first-call allocations (caches, the profiler's own) out of the measurement
        model.zero_grad(set_to_none=True)
    baseline = _allocations(unchunked)
    model.zero_grad(set_to_none=True)
    measured = _allocations(chunked)

    # The measurement sees the float32 logits where they exist.
    assert max(baseline) >= fp32_logits
    assert _peak(baseline) > 2 * fp32_logits
    # The chunked step: nothing bigger than one chunk's float32 logits (its softmax, the upcast copy on the CPU) ...
    assert max(measured) <= fp32_chunk
    # ... and at its peak it holds less than the float32 logits alone would take (the bf16 logits, half of that,
    # live from forward to backward, plus a chunk's float32 working set and the model's own activations).
    assert _peak(measured) < fp32_logits
