"""The preference losses against the published formulas, written out here again in float64 with Python's math on
each pair (an implementation of their own): values, and gradients with respect to the policy's log-probabilities
(by central finite differences of that float64 formula). The tolerance is float32's: ours run in float32."""

import math

import pytest
import torch

from toolkit.objectives.preference import PAIR_LOSSES, PairLogprobs, preference_losses

BETA = 0.3


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z)) if z >= 0 else z - math.log1p(math.exp(z))


def formula(kind: str, pc: float, pr: float, nc: int, nr: int, rc: float, rr: float, *, eps: float, gamma: float):
    """One pair's loss, from the papers (see toolkit/objectives/preference.py for the equation numbers)."""
    if kind == "dpo":  # Rafailov et al. 2023, Eq. 7; label smoothing as conservative DPO
        z = BETA * ((pc - rc) - (pr - rr))
        return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
    if kind == "ipo":  # Azar et al. 2023, Eq. 17, on length-averaged log-ratios
        return (((pc - rc) / nc - (pr - rr) / nr) - 1 / (2 * BETA)) ** 2
    if kind == "simpo":  # Meng et al. 2024, Eq. 6
        return -_log_sigmoid(BETA * pc / nc - BETA * pr / nr - gamma)
    # ORPO, Hong et al. 2024, Eqs. 6-7: odds(y) = P / (1 - P), P the length-normalized likelihood
    p_c, p_r = math.exp(pc / nc), math.exp(pr / nr)
    return -BETA * _log_sigmoid(math.log((p_c / (1 - p_c)) / (p_r / (1 - p_r))))


def pairs() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    n_c, n_r = torch.tensor([3.0, 17.0, 5.0, 40.0]), torch.tensor([9.0, 2.0, 5.0, 33.0])
    return {
        "chosen": -torch.rand(4, generator=generator) * n_c * 2, "rejected": -torch.rand(4, generator=generator) * n_r * 2,
        "chosen_tokens": n_c, "rejected_tokens": n_r,
        "ref_chosen": -torch.rand(4, generator=generator) * n_c * 2, "ref_rejected": -torch.rand(4, generator=generator) * n_r * 2,
    }


@pytest.mark.parametrize("kind,eps", [(kind, 0.0) for kind in PAIR_LOSSES] + [("dpo", 0.1)])  # smoothing is DPO's
def test_each_loss_and_its_gradients_are_the_published_formula(kind, eps):
    data = pairs()
    chosen, rejected = (data[k].clone().requires_grad_() for k in ("chosen", "rejected"))
    policy = PairLogprobs(chosen, rejected, data["chosen_tokens"], data["rejected_tokens"])
    reference = None if kind in ("simpo", "orpo") else PairLogprobs(
        data["ref_chosen"], data["ref_rejected"], data["chosen_tokens"], data["rejected_tokens"])
    ours = preference_losses(kind, policy, reference, beta=BETA, label_smoothing=eps, simpo_gamma=0.4)
    ours.loss.sum().backward()

    def theirs(i: int, dc: float = 0.0, dr: float = 0.0) -> float:
        return formula(kind, float(data["chosen"][i]) + dc, float(data["rejected"][i]) + dr,
                       int(data["chosen_tokens"][i]), int(data["rejected_tokens"][i]), float(data["ref_chosen"][i]),
                       float(data["ref_rejected"][i]), eps=eps, gamma=0.4)

    step = 1e-5
    for i in range(4):
        assert float(ours.loss[i].detach()) == pytest.approx(theirs(i), rel=1e-5, abs=1e-6)
        grad_c = (theirs(i, dc=step) - theirs(i, dc=-step)) / (2 * step)
        grad_r = (theirs(i, dr=step) - theirs(i, dr=-step)) / (2 * step)
        assert float(chosen.grad[i]) == pytest.approx(grad_c, rel=1e-4, abs=1e-6)
        assert float(rejected.grad[i]) == pytest.approx(grad_r, rel=1e-4, abs=1e-6)
    # The loss falls as the chosen answer gains on the rejected one (IPO's and smoothed DPO's only up to a margin).
    if kind != "ipo" and not eps:
        assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_rewards_are_the_implicit_ones():
    data = pairs()
    policy = PairLogprobs(data["chosen"], data["rejected"], data["chosen_tokens"], data["rejected_tokens"])
    reference = PairLogprobs(data["ref_chosen"], data["ref_rejected"], data["chosen_tokens"], data["rejected_tokens"])
    dpo = preference_losses("dpo", policy, reference, beta=BETA)
    torch.testing.assert_close(dpo.rewards_chosen, BETA * (data["chosen"] - data["ref_chosen"]))
    simpo = preference_losses("simpo", policy, beta=BETA)
    torch.testing.assert_close(simpo.rewards_rejected, BETA * data["rejected"] / data["rejected_tokens"])


@pytest.mark.parametrize("kind,kwargs,message", [
    ("kto", {}, "unknown pair loss 'kto'"),  # (toolkit.objectives.kto: not a pair loss)
    ("dpo", {"beta": 0.0}, "beta must be positive"),
    ("dpo", {"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
    ("dpo", {"reference": None}, "dpo needs a reference model"),
    ("simpo", {"reference": "given"}, "simpo takes no reference model"),
])
def test_bad_settings_are_refused(kind, kwargs, message):
    data = pairs()
    policy = PairLogprobs(data["chosen"], data["rejected"], data["chosen_tokens"], data["rejected_tokens"])
    reference = kwargs.pop("reference", policy)
    with pytest.raises(ValueError, match=message):
        preference_losses(kind, policy, policy if reference == "given" else reference, **{"beta": BETA, **kwargs})
