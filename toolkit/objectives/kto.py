"""KTO: preference tuning from answers judged one at a time, desirable or not, with no pairs needed.

Kahneman-Tversky Optimization (Ethayarajh et al., 2024, https://arxiv.org/abs/2402.01306, Eq. 8). For a prompt
``x`` and an answer ``y`` labelled desirable or undesirable, with ``r = log pi(y|x) - log ref(y|x)`` (summed over the
answer's tokens, as DPO's log-ratios are):

- the reference point ``z0 = max(0, mean r(x', y''))``, an estimate of the policy's KL divergence from the
  reference, taken on each prompt of the global batch followed by another sample's answer
  (:class:`~toolkit.data.UnpairedDataset`), and not backpropagated through;
- the value ``v = lambda_D sigmoid(beta (r - z0))`` for a desirable answer, ``lambda_U sigmoid(beta (z0 - r))`` for
  an undesirable one;
- the loss ``lambda_y - v``, ``lambda_y`` the answer's weight (``desirable_weight``, ``undesirable_weight``).

The training loss is the mean over every answer of the global batch, and ``z0`` is taken over the whole global
batch before its first micro-step (one forward without grad of the policy, and of a live reference, over the KL
sequences), so both are the same whatever the split into ranks and micro-steps. The paper estimates ``z0`` per
micro-batch; over the global batch it is the same estimator on more samples. The implicit reward reported is
``beta r``, DPO's, so a KTO run is validated on held-out pairs as a DPO run is (``reward_accuracy``).
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.parallel import gradient_sync, unwrap
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.objectives.preference import pair_inputs
from toolkit.training.step import StepResult, taken_routing_metrics

# The metrics of a step (metrics.jsonl's names): ``kl`` is z0; the others are means over the global batch's
# desirable or undesirable answers (a kind the batch has none of is left out of that step's record).
METRICS = ("kl", "rewards_desirable", "rewards_undesirable", "reward_margin", "logps_desirable", "logps_undesirable")


def kto_losses(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    *,
    kl: float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer (``[n]`` float32 summed log-probabilities under the policy and the reference, and whether each
    is desirable), KTO's loss against the reference point ``kl`` (z0; see the module docstring), and the implicit
    rewards ``beta r`` (detached).

    Raises:
        ValueError: ``beta`` or a weight not positive, or ``kl`` negative.
    """
    if beta <= 0 or desirable_weight <= 0 or undesirable_weight <= 0:
        raise ValueError(f"beta and the weights must be positive, got beta {beta}, desirable_weight "
                         f"{desirable_weight}, undesirable_weight {undesirable_weight}")
    if kl < 0:
        raise ValueError(f"the KL reference point is clamped at 0, got {kl}")
    ratio = policy - reference
    sign = torch.where(desirable, 1.0, -1.0)
    weight = torch.where(desirable, desirable_weight, undesirable_weight)
    loss = weight * (1 - torch.sigmoid(sign * beta * (ratio - kl)))
    return loss, (beta * ratio).detach()


def _rows(mb: dict[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    """One half of a KTO micro-batch (:func:`~toolkit.data.kto_collate`): the answers (``part`` ``:b``) or the KL
    sequences (``b:``), every per-row tensor sliced."""
    return {k: v[part] for k, v in mb.items() if k != "desirable"}


def _score(model, reference, mb: dict[str, torch.Tensor], *, flex_attention: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed log-probabilities of ``mb``'s rows under ``model`` and the reference (``reference``, else the
    batch's ``ref_logps``), float32."""
    inputs = pair_inputs(mb, flex_attention=flex_attention)
    policy = model(mb["tokens"], **inputs).float()
    ref = mb["ref_logps"] if reference is None else reference(mb["tokens"], **inputs)
    return policy, ref.float()


def kto_reference_point(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    device: torch.device,
    num_rows: int,
    reference=None,
    autocast: contextlib.AbstractContextManager | None = None,
    flex_attention: bool = False,
    data_parallel_group: dist.ProcessGroup | None = None,
) -> float:
    """z0 of one global batch: the mean log-ratio of the policy to the reference over its KL sequences (each
    prompt with another sample's answer; ``num_rows`` of them over the data-parallel ranks), clamped at 0. Forwards
    without grad; a collective."""
    total = torch.zeros(1, dtype=torch.float64, device=device)
    with torch.no_grad():
        for mb in micro_batches:
            mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
            half = mb["desirable"].numel()
            with autocast or contextlib.nullcontext():
                policy, ref = _score(model, reference, _rows(mb, slice(half, None)), flex_attention=flex_attention)
            total += (policy - ref).double().sum()
    return max(float(all_reduce_sum(total, group=data_parallel_group)) / max(num_rows, 1), 0.0)


def kto_forward_backward(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    settings,
    device: torch.device,
    data_parallel_size: int,
    data_parallel_group: dist.ProcessGroup | None = None,
    reference=None,
    autocast: contextlib.AbstractContextManager | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    flex_attention: bool = False,
) -> StepResult:
    """Accumulate the gradients of one global batch's share of KTO answers on this rank.

    Each micro-batch holds ``b`` answers and their ``b`` KL sequences (:func:`~toolkit.data.kto_collate`); the
    reference is called as in :func:`~toolkit.objectives.preference.preference_forward_backward`, or read from the
    batch's ``ref_logps``. First the reference point over the whole global batch (:func:`kto_reference_point`),
    then one forward and backward per micro-batch of its answers, each adding its answers' losses divided by the
    global batch's answers: the reduced gradient is the mean over every answer, whatever the split.
    ``settings``: :class:`~toolkit.objectives.preference.PreferenceSettings` (``beta``, ``desirable_weight``,
    ``undesirable_weight``).

    Returns:
        the step's loss (the mean over the global batch's answers), its trained tokens (the answers'), this rank's
        positions, and in ``metrics`` :data:`METRICS`, ``desirable`` and ``undesirable`` (the answers of each kind).
    """
    counts = torch.zeros(3, dtype=torch.float64)
    for mb in micro_batches:
        half = mb["desirable"].numel()
        counts += torch.tensor([half, int(mb["desirable"].sum()),
                                int((mb["labels"][:half] != CROSS_ENTROPY_IGNORE_INDEX).sum())])
    global_rows, global_desirable, global_tokens = (int(v) for v in all_reduce_sum(counts, group=data_parallel_group))
    kl = kto_reference_point(model, micro_batches, device=device, num_rows=global_rows, reference=reference,
                             autocast=autocast, flex_attention=flex_attention, data_parallel_group=data_parallel_group)
    # Sums over the rank's answers: loss; rewards and log-probabilities of the desirable, then the undesirable.
    totals = torch.zeros(5, dtype=torch.float64, device=device)
    num_positions = 0
    plain = unwrap(model)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        desirable = mb["desirable"]
        answers = _rows(mb, slice(None, desirable.numel()))
        num_positions += answers["tokens"].numel()
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast or contextlib.nullcontext():
                policy, ref = _score(model, reference, answers, flex_attention=flex_attention)
            losses, rewards = kto_losses(policy, ref, desirable, kl=kl, beta=settings.beta,
                                         desirable_weight=settings.desirable_weight,
                                         undesirable_weight=settings.undesirable_weight)
            loss = losses.sum() / global_rows
            router_loss = plain.take_router_loss() if hasattr(plain, "take_router_loss") else None
            if router_loss is not None:  # mixture of experts: the load-balancing loss, a mean over the batch's rows
                loss = loss + router_loss / global_rows
            scaled = loss * data_parallel_size  # (the gradient reduction averages over the ranks)
            (grad_scaler.scale(scaled) if grad_scaler is not None else scaled).backward()
        good = desirable.double()
        logps = policy.detach().double()
        totals += torch.stack([loss.detach().double() * global_rows, (rewards.double() * good).sum(),
                               (rewards.double() * (1 - good)).sum(), (logps * good).sum(), (logps * (1 - good)).sum()])
    totals = all_reduce_sum(totals, group=data_parallel_group).cpu()
    routed = taken_routing_metrics(plain, num_tokens=global_rows, group=data_parallel_group)
    global_undesirable = global_rows - global_desirable
    metrics = {"kl": kl, "desirable": global_desirable, "undesirable": global_undesirable}
    if global_desirable:
        metrics.update(rewards_desirable=float(totals[1]) / global_desirable,
                       logps_desirable=float(totals[3]) / global_desirable)
    if global_undesirable:
        metrics.update(rewards_undesirable=float(totals[2]) / global_undesirable,
                       logps_undesirable=float(totals[4]) / global_undesirable)
    if global_desirable and global_undesirable:
        metrics["reward_margin"] = metrics["rewards_desirable"] - metrics["rewards_undesirable"]
    return StepResult(loss=float(totals[0]) / max(global_rows, 1), num_tokens=global_tokens,
                      num_positions=num_positions, metrics={**metrics, **routed})


def check_kto_balance(num_desirable: int, num_undesirable: int, *, desirable_weight: float,
                      undesirable_weight: float) -> str | None:
    """A line for the log when the weighted balance of desirable to undesirable answers is outside the range the
    KTO paper recommends (``lambda_D n_D / (lambda_U n_U)`` in ``[1, 4/3]``), with the
    ``desirable_weight`` that would bring it in; None when inside."""
    if num_undesirable == 0 or num_desirable == 0:
        kind = "undesirable" if num_undesirable == 0 else "desirable"
        return f"kto: the dataset has no {kind} answers; the loss then only pushes the others' way"
    ratio = desirable_weight * num_desirable / (undesirable_weight * num_undesirable)
    if 1 <= ratio <= 4 / 3:
        return None
    low, high = (undesirable_weight * num_undesirable / num_desirable * r for r in (1, 4 / 3))
    return (f"kto: desirable_weight x {num_desirable} desirable / (undesirable_weight x {num_undesirable} "
            f"undesirable) = {ratio:.2f}; the KTO paper advises 1 to 4/3 (desirable_weight {low:.3g} to {high:.3g})")
