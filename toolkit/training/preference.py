"""Preference losses: DPO and its relatives, on the per-sequence log-probabilities of chosen and rejected answers.

Each pair ``i`` has its chosen answer's summed log-probability under the policy ``pi_c`` and the rejected one's
``pi_r`` (:func:`~toolkit.modules.loss.linear_sequence_logprobs`), their answer token counts ``n_c`` and ``n_r``,
and, for the losses with a reference model, the reference's ``ref_c`` and ``ref_r``. Every loss below is per pair;
the training loss is their sum over a rank's pairs divided by the pairs of the global batch, so that it is the mean
over every pair whatever the split into ranks and micro-steps.

- ``dpo`` (Rafailov et al., 2023, https://arxiv.org/abs/2305.18290, Eq. 7), with label smoothing ``eps``
  (conservative DPO, Mitchell, 2023): ``h = (pi_c - ref_c) - (pi_r - ref_r)``,
  ``loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``.
- ``ipo`` (Azar et al., 2023, https://arxiv.org/abs/2310.12036, Eq. 17): ``loss = (h - 1 / (2 beta))^2``, with
  ``h`` of the length-averaged log-ratios (``(pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r``), as TRL computes it;
  the paper's ``h`` is of whole sequences.
- ``simpo`` (Meng et al., 2024, https://arxiv.org/abs/2405.14734, Eq. 6), reference-free:
  ``loss = -log sigmoid(beta pi_c / n_c - beta pi_r / n_r - gamma)``, ``gamma`` the target reward margin.
- ``orpo`` (Hong et al., 2024, https://arxiv.org/abs/2403.07691, Eqs. 6-7), reference-free: the odds ratio term
  ``loss = -beta log sigmoid(log odds(c) - log odds(r))``, ``odds = p / (1 - p)`` of the length-averaged
  probability ``p = exp(pi / n)`` (``beta`` is the paper's ``lambda``); the recipe adds the supervised term, the
  chosen answers' cross-entropy over the global batch's chosen tokens.

The implicit rewards reported beside them are ``beta (pi - ref)`` (``dpo``), ``beta (pi - ref) / n`` (``ipo``) and
``beta pi / n`` (``simpo``, ``orpo``).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = ("dpo", "ipo", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclass(frozen=True)
class PairLogprobs:
    """Summed log-probabilities of the chosen and rejected answers of each pair (``[pairs]``, float32), and the
    answers' token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


@dataclass(frozen=True)
class PairLosses:
    """Per pair: the loss, and the implicit rewards of the chosen and rejected answers (detached)."""

    loss: torch.Tensor
    rewards_chosen: torch.Tensor
    rewards_rejected: torch.Tensor


def preference_losses(
    kind: str,
    policy: PairLogprobs,
    reference: PairLogprobs | None = None,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> PairLosses:
    """The per-pair losses of ``kind`` (one of :data:`LOSSES`, see the module docstring) and the implicit rewards.

    Raises:
        ValueError: an unknown ``kind``, ``beta`` not positive, ``label_smoothing`` outside ``[0, 0.5)``, or a
            reference missing for ``dpo``/``ipo`` (or given to a reference-free loss).
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; choose one of {', '.join(LOSSES)}")
    if beta <= 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if (reference is None) != (kind in REFERENCE_FREE):
        raise ValueError(f"{kind} {'takes no' if kind in REFERENCE_FREE else 'needs a'} reference model")
    chosen_mean = policy.chosen / policy.chosen_tokens
    rejected_mean = policy.rejected / policy.rejected_tokens
    if kind == "dpo":
        ratio_c, ratio_r = policy.chosen - reference.chosen, policy.rejected - reference.rejected
        z = beta * (ratio_c - ratio_r)
        loss = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
        rewards = (beta * ratio_c, beta * ratio_r)
    elif kind == "ipo":
        ratio_c = (policy.chosen - reference.chosen) / policy.chosen_tokens
        ratio_r = (policy.rejected - reference.rejected) / policy.rejected_tokens
        loss = (ratio_c - ratio_r - 1 / (2 * beta)).square()
        rewards = (beta * ratio_c, beta * ratio_r)
    elif kind == "simpo":
        loss = -F.logsigmoid(beta * (chosen_mean - rejected_mean) - simpo_gamma)
        rewards = (beta * chosen_mean, beta * rejected_mean)
    else:  # orpo: log odds = log p - log(1 - p), with log(1 - p) = log(-expm1(log p)), exact near p = 1 too
        log_odds = (chosen_mean - torch.log(-torch.expm1(chosen_mean))) - (
            rejected_mean - torch.log(-torch.expm1(rejected_mean))
        )
        loss = -beta * F.logsigmoid(log_odds)
        rewards = (beta * chosen_mean, beta * rejected_mean)
    return PairLosses(loss=loss, rewards_chosen=rewards[0].detach(), rewards_rejected=rewards[1].detach())
