"""linear_sequence_logprobs: each row's summed label log-probability from the hidden states and the output weight,
chunk by chunk within rows, its gradients taken in backward by projecting again; against float64 autograd through
whole logits, for a weighted sum of the rows (a preference loss weighs each row differently)."""

import pytest
import torch

from tests.modules.test_linear_cross_entropy import (
    IGNORE,
    VOCAB,
    _lora_model,
    _models,
    inputs,
    lora_inputs,
    relative_error,
)
from toolkit.modules.loss import linear_sequence_logprobs

ROW_WEIGHTS = torch.tensor([0.7, -1.3, 0.0])
GEMMA = "gemma2 (soft-capped, tied, scaled embedding)"


def _rows(h, weight, labels):
    # A third row of nothing to score (all ignored): its value is 0 and it passes no gradient.
    return (torch.cat([h, h[:1].detach()]).detach().requires_grad_(h.requires_grad), weight,
            torch.cat([labels, torch.full_like(labels[:1], IGNORE)]))


def reference_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per row, the sum over its non-ignored positions of log softmax(logits)[label], written out in float64."""
    logits = logits.double()
    log_probs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    kept = labels != IGNORE
    picked = log_probs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(kept, picked, 0.0).sum(dim=1)


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("chunk_size", [1, 5, 1024])  # 1: a chunk per position; 1024: one per row
def test_float32_matches_float64_autograd(chunk_size, softcap):
    h, weight, labels = _rows(*inputs(torch.float32))
    ours = linear_sequence_logprobs(h, weight, labels, chunk_size=chunk_size, softcap=softcap)
    (ours * ROW_WEIGHTS).sum().backward()
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, weight))
    logits = h64 @ w64.T
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = reference_logprobs(logits, labels)
    (expected * ROW_WEIGHTS.double()).sum().backward()
    # float32 sums over 50 logits and ~30 positions a row: measured below 1e-6 relative.
    torch.testing.assert_close(ours.double(), expected, rtol=2e-6, atol=0)
    assert float(ours[2].detach()) == 0.0
    assert relative_error(h.grad, h64.grad) < 5e-6 and relative_error(weight.grad, w64.grad) < 5e-6
    assert torch.count_nonzero(h.grad[labels == IGNORE]) == 0


@pytest.mark.parametrize("separate_input", [False, True], ids=["x is h", "x apart (dropout)"])
def test_a_lora_adapter_on_the_projection_matches_float64_autograd(separate_input):
    h, weight, labels, adapter = lora_inputs(separate_input=separate_input, trained_weight=True)
    ours = linear_sequence_logprobs(h, weight, labels, adapter=adapter, chunk_size=7)
    (ours * ROW_WEIGHTS[:2]).sum().backward()
    leaves = [t.detach().double().requires_grad_() for t in (h, weight, adapter.x, adapter.lora_a, adapter.lora_b)]
    h64, w64, x64, a64, b64 = leaves
    x64 = h64 if adapter.x is h else x64
    expected = reference_logprobs(h64 @ w64.T + adapter.scale * (x64 @ a64.T) @ b64.T, labels)
    (expected * ROW_WEIGHTS[:2].double()).sum().backward()
    torch.testing.assert_close(ours.double(), expected, rtol=2e-6, atol=0)
    grads = [h.grad, weight.grad, adapter.x.grad, adapter.lora_a.grad, adapter.lora_b.grad]
    for name, grad, leaf in zip(["h", "weight", "x", "A", "B"], grads, leaves):
        if name == "x" and not separate_input:
            continue  # x is h: both paths' gradients are in h's
        assert relative_error(grad, leaf.grad) < 5e-6, name


def test_without_grad_and_bad_chunk_size():
    h, weight, labels = inputs(torch.float32)
    with torch.no_grad():
        values = linear_sequence_logprobs(h, weight, labels, chunk_size=4)
    assert values.shape == (2,) and not values.requires_grad and (values < 0).all()
    nothing = linear_sequence_logprobs(h, weight, torch.full_like(labels, IGNORE))
    nothing.sum().backward()
    assert nothing.tolist() == [0.0, 0.0] and torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(weight.grad) == 0
    with pytest.raises(ValueError, match="chunk_size must be at least 1"):
        linear_sequence_logprobs(h, weight, labels, chunk_size=0)
    assert VOCAB == weight.shape[0]


def _model(name: str) -> torch.nn.Module:
    # test_linear_cross_entropy.py's: Gemma 2 soft-capped and tied; Llama 3 with LoRA on its output (B random).
    return dict(_models())[GEMMA] if name == "gemma2" else _lora_model()


@pytest.mark.parametrize("name", ["gemma2", "lora_llama3"])
def test_the_decoders_per_sequence_path_fused_and_not_is_its_logits_log_probabilities(name):
    model = _model(name)
    vocab = model.embed_tokens.weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (3, 20), generator=generator)
    labels = torch.randint(0, vocab, (3, 20), generator=generator)
    labels[0, :7], labels[2, 15:] = IGNORE, IGNORE
    with torch.no_grad():
        expected = reference_logprobs(model(tokens), labels)
    grads = []
    for fused in (True, False):
        model.zero_grad()
        values = model(tokens, labels=labels, per_sequence=True, fused_loss=fused)
        (values * ROW_WEIGHTS).sum().backward()
        # float32 through the model against the float64 softmax of its float32 logits: 2e-6 relative.
        torch.testing.assert_close(values.double(), expected, rtol=2e-6, atol=0)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for key in grads[0]:  # the fused gradients, taken in backward, are autograd's through the logits
        assert relative_error(grads[0][key], grads[1][key]) < 1e-5, key
