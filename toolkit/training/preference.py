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

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.modules.peft import disable_adapters
from toolkit.parallel import gradient_sync, unwrap
from toolkit.training.attention import batch_attention_mask
from toolkit.training.distributed import all_reduce_sum

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


# --- One optimizer step's micro-batches ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PreferenceSettings:
    """The loss of a preference run (``preference_loss``, ``beta``...: see :func:`preference_losses`)."""

    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


# The metrics of a step, means over the pairs of the global batch (metrics.jsonl's names).
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected")


@dataclass(frozen=True)
class PreferenceStepResult:
    """A step's loss (the mean over the global batch's pairs, ORPO's supervised term included), its pairs, and
    :data:`METRICS`."""

    loss: float
    num_pairs: int
    metrics: dict[str, float]


def lora_reference(model: nn.Module) -> Callable[..., torch.Tensor]:
    """The reference of a LoRA/DoRA policy: its base, the adapters switched off (no second copy in memory)."""

    def reference(*args, **kwargs) -> torch.Tensor:
        with torch.no_grad(), disable_adapters(unwrap(model)):
            return model(*args, **kwargs)

    return reference


def preference_forward_backward(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    settings: PreferenceSettings,
    device: torch.device,
    data_parallel_size: int,
    data_parallel_group: dist.ProcessGroup | None = None,
    reference: Callable[..., torch.Tensor] | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    flex_attention: bool = False,
) -> PreferenceStepResult:
    """Accumulate the gradients of one global batch's share of preference pairs on this rank.

    Each micro-batch holds ``b`` pairs as ``2b`` rows (:func:`~toolkit.data.preference_collate`: the chosen answers,
    then the rejected ones), scored in one forward (:meth:`~toolkit.modules.TransformerDecoder.forward` with
    ``per_sequence=True``: summed log-probabilities of each row's trained tokens, the fused projection keeping no
    logits). The reference's log-probabilities come from ``reference`` (called as the model is, without grad:
    :func:`lora_reference`, a frozen copy), or, where the batch carries them (``ref_logps`` ``[2b]``, computed once
    before training), from the batch; reference-free losses take none. The global count of pairs (and, for ORPO,
    of chosen tokens) is taken first, so every micro-batch adds its pairs' losses divided by the global pairs: the
    accumulated, reduced gradient is the mean over every pair, whatever the split into ranks and micro-steps.
    ``grad_scaler`` (fp16) scales each backward, as :func:`~toolkit.training.forward_backward` does.
    """
    pairs_and_tokens = torch.zeros(2, dtype=torch.float64)
    for mb in micro_batches:
        half = mb["labels"].shape[0] // 2
        pairs_and_tokens += torch.tensor([half, int((mb["labels"][:half] != CROSS_ENTROPY_IGNORE_INDEX).sum())])
    global_pairs, global_chosen_tokens = (int(v) for v in all_reduce_sum(pairs_and_tokens, group=data_parallel_group))
    totals = torch.zeros(1 + len(METRICS), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        half = mb["labels"].shape[0] // 2
        inputs = dict(mask=batch_attention_mask(mb, flex_attention=flex_attention), input_pos=mb.get("input_pos"),
                      labels=mb["labels"], per_sequence=True)
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast or contextlib.nullcontext():
                logps = model(mb["tokens"], **inputs)  # [2b]
                ref_logps = None
                if settings.needs_reference:
                    ref_logps = mb["ref_logps"] if reference is None else reference(mb["tokens"], **inputs)
            counts = (mb["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum(dim=1).float()
            policy = PairLogprobs(logps[:half], logps[half:], counts[:half], counts[half:])
            ref = None if ref_logps is None else PairLogprobs(
                ref_logps[:half].float(), ref_logps[half:].float(), counts[:half], counts[half:])
            out = preference_losses(
                settings.loss, policy, ref, beta=settings.beta, label_smoothing=settings.label_smoothing,
                simpo_gamma=settings.simpo_gamma,
            )
            loss = out.loss.sum() / global_pairs
            if settings.loss == "orpo":  # its supervised term: the chosen answers' mean token cross-entropy
                loss = loss - policy.chosen.sum() / max(global_chosen_tokens, 1)
            scaled = loss * data_parallel_size  # (the gradient reduction averages over the ranks)
            (grad_scaler.scale(scaled) if grad_scaler is not None else scaled).backward()
        chosen, rejected = policy.chosen.detach(), policy.rejected.detach()
        totals += torch.stack([
            loss.detach().double() * global_pairs, out.rewards_chosen.sum(), out.rewards_rejected.sum(),
            (out.rewards_chosen - out.rewards_rejected).sum(), (out.rewards_chosen > out.rewards_rejected).sum(),
            chosen.sum(), rejected.sum(),
        ]).double()
    totals = all_reduce_sum(totals, group=data_parallel_group).cpu() / max(global_pairs, 1)
    return PreferenceStepResult(
        loss=float(totals[0]), num_pairs=global_pairs, metrics=dict(zip(METRICS, totals[1:].tolist())),
    )
