"""The online RL objectives against their papers' formulas, written out again here in float64 with Python's math
over lists, one completion and one token at a time:

- GRPO: Shao et al. 2024 (DeepSeekMath), eq. 3 (the clipped surrogate averaged over each output's tokens, then over
  the outputs) with eq. 4 (the k3 KL estimate) and section 4.1.2 (group-normalized outcome advantages);
- Dr. GRPO: Liu et al. 2025, eq. 2 / section 3.2 (advantages not divided by the standard deviation, the sum over
  tokens divided by a constant length, not each output's own);
- DAPO: Yu et al. 2025, eq. 8 (clip-higher: an asymmetric range; token-level normalization over the batch);
- GSPO: Zheng et al. 2025, eqs. 5-7 (the sequence-level ratio, the geometric mean of the token ratios).

The loss and its gradient with respect to every token log-probability (central finite differences of the formula,
step 1e-6 in float64) are compared at 1e-6; one step of a tiny Llama in float64 against the loss computed from its
whole logits; and the same step's gradient whatever the split of the global batch into micro-batches (exact
normalization).
"""

import math

import pytest
import torch

from toolkit.models.llama3 import llama3_demo
from toolkit.objectives.rl import (
    RLSettings,
    group_advantages,
    normalizer,
    rl_forward_backward,
    rl_objective,
    rollout_batch,
)
from toolkit.training import init_weights

CPU = torch.device("cpu")


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # the sample standard deviation (n - 1), as TRL's torch.std
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def advantages_formula(groups: list[list[float]], *, scale: bool) -> list[float]:
    out = []
    for rewards in groups:
        m, s = _mean(rewards), _std(rewards)
        out += [(r - m) / (s + 1e-4) if scale else r - m for r in rewards]
    return out


def _clip(x, low, high):
    return min(max(x, low), high)


def loss_formula(logps, old, ref, advantages, *, loss, eps_low, eps_high, beta, max_len):
    """Minus the objective of one global batch: ``logps``, ``old``, ``ref`` lists of per-token lists."""
    n = len(logps)
    total_tokens = sum(len(seq) for seq in logps)
    seq_terms, token_sum = [], 0.0
    for lp, ol, rf, a in zip(logps, old, ref, advantages):
        kls = [math.exp(r - p) - (r - p) - 1 for p, r in zip(lp, rf)] if beta else [0.0] * len(lp)
        if loss == "gspo":
            s = math.exp(sum(p - o for p, o in zip(lp, ol)) / len(lp))
            j = min(s * a, _clip(s, 1 - eps_low, 1 + eps_high) * a)
            seq_terms.append(-j + beta * _mean(kls))
            continue
        terms = []
        for p, o, kl in zip(lp, ol, kls):
            ratio = math.exp(p - o)
            terms.append(-min(ratio * a, _clip(ratio, 1 - eps_low, 1 + eps_high) * a) + beta * kl)
        seq_terms.append(_mean(terms))
        token_sum += sum(terms)
    if loss in ("grpo", "gspo"):
        return sum(seq_terms) / n
    if loss == "dr_grpo":
        return token_sum / (n * max_len)
    return token_sum / total_tokens  # dapo


SETTINGS = {
    "grpo": dict(eps_low=0.2, eps_high=0.2, beta=0.04),
    "dr_grpo": dict(eps_low=0.2, eps_high=0.2, beta=0.0),
    "dapo": dict(eps_low=0.2, eps_high=0.28, beta=0.0),
    "gspo": dict(eps_low=3e-3, eps_high=4e-3, beta=0.02),
}


def _rollouts(seed: int):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 5, 1, 4, 6, 2, 5, 3]  # two groups of four completions
    T = max(lengths)
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    old = (-torch.rand(len(lengths), T, generator=g, dtype=torch.float64) * 3) * mask
    # The policy moved a little (ratios on both sides of the clip range), the reference elsewhere.
    logps = (old + torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * 0.3) * mask
    ref = (old + torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * 0.5) * mask
    rewards = [[1.0, 0.0, 0.5, 1.0], [0.0, 0.2, 0.0, 1.0]]
    return lengths, mask, old, logps, ref, rewards


@pytest.mark.parametrize("loss", list(SETTINGS))
def test_the_loss_and_its_gradients_are_the_papers_formulas(loss):
    opts = SETTINGS[loss]
    lengths, mask, old, logps, ref, rewards = _rollouts(seed=1)
    settings = RLSettings(loss=loss, clip_low=opts["eps_low"], clip_high=opts["eps_high"], kl_coef=opts["beta"],
                          max_new_tokens=8)
    advantages = group_advantages(torch.tensor(rewards, dtype=torch.float64), scale=settings.scale_advantages)
    expected_adv = advantages_formula(rewards, scale=settings.scale_advantages)
    assert advantages.flatten().tolist() == pytest.approx(expected_adv, abs=1e-12)

    logps = logps.clone().requires_grad_(True)
    terms = rl_objective(logps, old, mask, advantages.flatten(), settings=settings, ref_logps=ref)
    norm = normalizer(settings, num_sequences=len(lengths), num_tokens=sum(lengths))
    loss_value = terms.loss_sum / norm
    loss_value.backward()

    def as_lists(t):
        return [t[i, :n].tolist() for i, n in enumerate(lengths)]

    def formula(lp):
        return loss_formula(lp, as_lists(old), as_lists(ref), expected_adv, loss=loss, max_len=8, **opts)

    assert loss_value.item() == pytest.approx(formula(as_lists(logps.detach())), abs=1e-6, rel=0)
    # The gradient of every token log-probability: central differences of the formula.
    h = 1e-6
    for i, n in enumerate(lengths):
        for t in range(n):
            up, down = as_lists(logps.detach()), as_lists(logps.detach())
            up[i][t] += h
            down[i][t] -= h
            numeric = (formula(up) - formula(down)) / (2 * h)
            assert logps.grad[i, t].item() == pytest.approx(numeric, abs=1e-6), (loss, i, t)
    assert logps.grad[~mask].abs().max() == 0  # padding carries nothing


def test_equal_rewards_give_no_advantage_and_the_clip_counts():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    adv = group_advantages(rewards, scale=True)
    assert adv[0].abs().max() == 0  # a group that teaches nothing (dapo's dynamic sampling drops it)
    assert adv[1].sum().abs() < 1e-12
    # Ratios 1.5 and 0.5 with positive and negative advantages: clipped where the clip binds in its direction.
    logps = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]], dtype=torch.float64))
    terms = rl_objective(logps, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool),
                         torch.tensor([1.0, -1.0], dtype=torch.float64), settings=RLSettings(loss="dapo"))
    assert terms.clipped.item() == 2 and terms.clip_units == 4  # (1.5, A>0) and (0.5, A<0)


def _model():
    torch.manual_seed(0)
    model = llama3_demo(max_seq_len=32).double()
    init_weights(model)
    return model


@pytest.mark.parametrize("loss", ["grpo", "dapo", "gspo", "dr_grpo"])
def test_a_step_of_a_model_is_the_formula_on_its_whole_logits_on_any_split(loss):
    """rl_forward_backward on a float64 Llama: its loss is the formula on the log-probabilities taken from the
    whole logits, and its gradient is the same whether the global batch is one micro-batch, two, or two ranks' worth
    (simulated: each half's gradient with data_parallel_size 2, averaged as the reduction would)."""
    opts = SETTINGS[loss]
    settings = RLSettings(loss=loss, clip_low=opts["eps_low"], clip_high=opts["eps_high"], kl_coef=0.0,
                          max_new_tokens=6)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (3, 3, 5, 5)]
    completions = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (2, 6, 1, 4)]
    adv = group_advantages(torch.tensor([[1.0, 0.0], [0.3, 1.0]], dtype=torch.float64),
                           scale=settings.scale_advantages).flatten().tolist()
    model = _model()
    # Old log-probabilities a little away from the model's, so that ratios are not all 1.
    full = rollout_batch(prompts, completions, adv, pad_id=0)
    with torch.no_grad():
        logits = model(full.tokens).log_softmax(-1)
    lp = logits.gather(-1, full.labels.clamp(min=0)[..., None])[..., 0] * full.mask
    old = (lp + torch.randn(lp.shape, generator=g, dtype=torch.float64) * 0.01) * full.mask
    norm = normalizer(settings, num_sequences=4, num_tokens=int(full.mask.sum()))

    def batch(rows):
        b = rollout_batch([prompts[i] for i in rows], [completions[i] for i in rows], [adv[i] for i in rows],
                          pad_id=0, seq_len=full.tokens.shape[1])
        b.old_logps = old[rows]
        return b

    def grads(splits, dp):
        model.zero_grad()
        losses = []
        for rank_rows in splits:
            result = rl_forward_backward(model, [batch(rows) for rows in rank_rows], settings=settings, norm=norm,
                                         device=CPU, data_parallel_size=dp)
            losses.append(result.loss)
        return [p.grad.clone() / dp for p in model.parameters()], losses

    one, (loss_one,) = grads([[[0, 1, 2, 3]]], dp=1)
    seqs = [[lp[i, full.mask[i]].tolist()] for i in range(4)]
    olds = [[old[i, full.mask[i]].tolist()] for i in range(4)]
    expected = loss_formula([s[0] for s in seqs], [o[0] for o in olds], [o[0] for o in olds], adv, loss=loss,
                            max_len=6, **{**opts, "beta": 0.0})
    assert loss_one == pytest.approx(expected, abs=1e-9)
    micro, _ = grads([[[0, 1], [2, 3]]], dp=1)
    ranks, rank_losses = grads([[[0, 1]], [[2, 3]]], dp=2)  # each rank's loss is its share
    for a, b, c in zip(one, micro, ranks):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=0)
        torch.testing.assert_close(c, a, atol=1e-12, rtol=0)
    assert sum(rank_losses) == pytest.approx(loss_one, abs=1e-12)
