"""Distillation losses (toolkit.modules.distillation) against the papers' formulas written out in float64, their
gradients included; the same on any chunking; no whole logits kept for backward; refusals."""

import math

import pytest
import torch

from toolkit.modules.distillation import DIVERGENCES, linear_distillation_sum, token_divergence

T_POS, D_S, D_T, VOCAB = 12, 8, 16, 40


def inputs(seed: int = 0, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    student_h = torch.randn(T_POS, D_S, generator=g)
    student_w = torch.randn(vocab, D_S, generator=g) * 0.7
    teacher_h = torch.randn(T_POS, D_T, generator=g)
    teacher_w = torch.randn(vocab, D_T, generator=g) * 0.5
    return student_h, student_w, teacher_h, teacher_w


def float64_reference(student_h, student_w, teacher_h, teacher_w, kind, temperature, beta):
    """The summed per-position divergence from softmaxes written out: p_i = exp(z_i - max) / sum_j exp(z_j - max).
    Forward KL: sum_i q_i log(q_i / p_i) (Hinton et al., 2015, Sec. 2); reverse KL: sum_i p_i log(p_i / q_i) (Gu et
    al., 2024, Eq. 1); generalized JSD: beta KL(q || m) + (1 - beta) KL(p || m), m = beta q + (1 - beta) p
    (Agarwal et al., 2024, Eq. 4); each times T^2."""
    z = (student_h.double() @ student_w.double().T) / temperature
    y = (teacher_h.double() @ teacher_w.double().T) / temperature
    p = torch.exp(z - z.max(-1, keepdim=True).values)
    p = p / p.sum(-1, keepdim=True)
    q = torch.exp(y - y.max(-1, keepdim=True).values)
    q = q / q.sum(-1, keepdim=True)

    def kl(a, b):
        return (a * torch.log(a / b)).sum(-1)

    if kind == "forward_kl":
        per = kl(q, p)
    elif kind == "reverse_kl":
        per = kl(p, q)
    else:
        m = beta * q + (1 - beta) * p
        per = beta * kl(q, m) + (1 - beta) * kl(p, m)
    return per.sum() * temperature**2


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_loss_and_its_gradients_are_the_formula_in_float64(kind, temperature):
    beta = 0.3
    sh, sw, th, tw = inputs()
    sh.requires_grad_(True)
    sw.requires_grad_(True)
    ours = linear_distillation_sum(sh, sw, th, tw, kind=kind, temperature=temperature, beta=beta, num_chunks=3)
    ours.backward()
    sh64, sw64 = sh.detach().double().requires_grad_(True), sw.detach().double().requires_grad_(True)
    reference = float64_reference(sh64, sw64, th, tw, kind, temperature, beta)
    reference.backward()
    # float32 softmaxes over 40 tokens against float64: relative 1e-5 on a sum of 12 positions.
    assert ours.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(sh.grad.double(), sh64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sw.grad.double(), sw64.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_any_chunking_gives_the_same_loss_and_gradients(kind):
    results = []
    for chunks in (1, 5, T_POS + 3):  # more chunks than positions: empty chunks are skipped
        sh, sw, th, tw = inputs()
        sh.requires_grad_(True)
        sw.requires_grad_(True)
        loss = linear_distillation_sum(sh, sw, th, tw, kind=kind, num_chunks=chunks)
        loss.backward()
        results.append((loss.detach(), sh.grad, sw.grad))
    # The weight's gradient is summed over the chunks in another order: float32 rounding of O(1) terms.
    for loss, gh, gw in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(gh, results[0][1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gw, results[0][2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_a_student_equal_to_its_teacher_has_nothing_to_learn(kind):
    sh, sw, _, _ = inputs()
    sh.requires_grad_(True)
    loss = linear_distillation_sum(sh, sw, sh.detach(), sw, kind=kind, temperature=1.5)
    loss.backward()
    assert abs(loss.item()) < 1e-5 and sh.grad.abs().max() < 1e-5


def test_the_jsd_is_bounded_and_symmetric_at_one_half():
    sh, sw, th, tw = inputs()
    per = token_divergence(sh @ sw.T, th @ tw.T, kind="jsd", beta=0.5)
    swapped = token_divergence(th @ tw.T, sh @ sw.T, kind="jsd", beta=0.5)
    assert (per >= -1e-6).all() and (per <= math.log(2) + 1e-6).all()
    torch.testing.assert_close(per, swapped, rtol=1e-5, atol=1e-6)


def test_backward_keeps_no_chunk_of_logits():
    # The checkpointed chunks save their inputs only: no [positions, vocab] tensor waits for backward.
    sh, sw, th, tw = inputs()
    sh.requires_grad_(True)
    sw.requires_grad_(True)
    saved = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        linear_distillation_sum(sh, sw, th, tw, num_chunks=4)
    assert saved and all(VOCAB not in shape or shape == sw.shape or shape == tw.shape for shape in saved), saved


def test_refusals_name_what_is_wrong():
    sh, sw, th, tw = inputs()
    with pytest.raises(ValueError, match="vocabulary"):
        linear_distillation_sum(sh, sw, th, tw[:-1])
    with pytest.raises(ValueError, match="temperature"):
        linear_distillation_sum(sh, sw, th, tw, temperature=0)
    with pytest.raises(ValueError, match="beta"):
        linear_distillation_sum(sh, sw, th, tw, kind="jsd", beta=1.0)
    with pytest.raises(ValueError, match="unknown divergence"):
        linear_distillation_sum(sh, sw, th, tw, kind="kl")


def test_a_vocabulary_split_over_two_processes_gives_the_same_loss_and_gradients():
    # Each divergence, with a temperature and with soft-capped logits, on 41 tokens split 21/20 over a TP mesh of 2:
    # against the unsplit computation (float32 rounding) and the float64 formula (see the worker).
    from tests.launch import REPO, run_workers

    result = run_workers(REPO / "tests" / "modules" / "_distill_tp_worker.py", nproc=2, timeout_s=180,
                         per_rank_logs=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all cases equal" in result.stdout
