"""Online RL objectives on sampled completions: GRPO, Dr. GRPO, DAPO and GSPO.

Each prompt's ``G`` completions form a group; a completion's advantage is its reward against its group's
(:func:`group_advantages`), and the policy is moved toward the better ones through a clipped importance ratio
between the policy being trained (``logps``) and the one that sampled (``old_logps``). Per token ``t`` of completion
``i`` (``r = exp(logp - old_logp)``, ``A`` the completion's advantage):

- ``grpo`` (Shao et al. 2024, DeepSeekMath, eq. 3): advantages ``(R - mean) / (std + 1e-4)`` over the group (the
  sample standard deviation, as TRL computes it); the token terms ``min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``
  minus ``kl_coef`` times the k3 estimate of the KL to the reference (eq. 4: ``ref/p - log(ref/p) - 1``), averaged
  over each completion's tokens, then over the completions of the global batch.
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", eq. 2 and section 3.2): advantages
  ``R - mean`` (no division by the standard deviation), and the token terms summed and divided by the number of
  completions times ``max_new_tokens``, a constant: no bias toward long wrong answers or short right ones.
- ``dapo`` (Yu et al. 2025, eq. 8): GRPO's advantages, an asymmetric clip (``eps_high > eps_low``: "clip-higher"),
  and the token terms averaged over every completion token of the global batch (token-level normalization); its
  dynamic sampling (eq. 11) and overlong reward shaping (eq. 13) are the recipe's and the rewards'.
- ``gspo`` (Zheng et al. 2025, eqs. 5-7): one ratio per completion, ``s = exp(mean over its tokens of (logp -
  old_logp))``, clipped as above (GSPO's clip ranges are of order 1e-3), times its advantage; averaged over the
  completions (the KL term, if any, is each completion's mean over its tokens).

The loss is minus the objective. **Exact normalization**: every micro-batch contributes the sum of its completions'
(or tokens') terms divided by the global batch's count (:func:`normalizer`, from the counts summed over every rank
before the first backward), so the gradient is that of the global batch whatever its split over ranks and
micro-steps, as the supervised loss is.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from toolkit.modules.masks import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.modules.moe import RoutingRecord, replay_routing, routing_agreement
from toolkit.parallel import gradient_sync
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.training.step import StepResult
from toolkit.training.watchdog import progress

RL_LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")
# What each objective averages over: completions (each its mean over its tokens), completions times a constant
# length, or tokens.
_LEVEL = {"grpo": "sequence", "dr_grpo": "constant", "dapo": "token", "gspo": "sequence"}
ADVANTAGE_EPS = 1e-4  # added to the group's standard deviation (as TRL: a group of equal rewards gets 0, not nan)


@dataclass(frozen=True)
class RLSettings:
    """An objective and its constants.

    Attributes:
        loss: one of :data:`RL_LOSSES`.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        kl_coef: the weight of the k3 KL estimate to the reference (0: no reference is run).
        max_new_tokens: ``dr_grpo``'s constant completion length.
    """

    loss: str = "grpo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    max_new_tokens: int = 1

    def __post_init__(self) -> None:
        if self.loss not in RL_LOSSES:
            raise ValueError(f"loss must be one of {', '.join(RL_LOSSES)}, got {self.loss!r}")

    @property
    def scale_advantages(self) -> bool:
        """Whether advantages are divided by the group's standard deviation (all but ``dr_grpo``)."""
        return self.loss != "dr_grpo"


def group_advantages(rewards: torch.Tensor, *, scale: bool) -> torch.Tensor:
    """Each completion's advantage within its group: ``rewards`` ``[groups, G]`` less the group's mean, divided by
    the group's sample standard deviation plus :data:`ADVANTAGE_EPS` when ``scale``."""
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if not scale:
        return centered
    return centered / (rewards.std(dim=-1, keepdim=True) + ADVANTAGE_EPS)


def normalizer(settings: RLSettings, *, num_sequences: int, num_tokens: int) -> float:
    """What the global batch's summed terms are divided by: its completions (``grpo``, ``gspo``), completions times
    ``max_new_tokens`` (``dr_grpo``) or completion tokens (``dapo``)."""
    level = _LEVEL[settings.loss]
    count = {"sequence": num_sequences, "constant": num_sequences * settings.max_new_tokens, "token": num_tokens}[level]
    return float(max(count, 1))


@dataclass
class ObjectiveTerms:
    """One micro-batch's summed terms (:func:`rl_objective`).

    Attributes:
        loss_sum: minus the objective, summed at the objective's level (divide by :func:`normalizer`).
        clipped: tokens (sequences for ``gspo``) whose clipped term was the smaller one, i.e. carry no gradient.
        clip_units: the tokens (sequences) counted in ``clipped``.
        kl_sum: the summed k3 KL estimate over tokens (0 without a reference).
        ratio_sum: the summed importance ratio over tokens (``gspo``: sequences).
    """

    loss_sum: torch.Tensor
    clipped: torch.Tensor
    clip_units: int
    kl_sum: torch.Tensor
    ratio_sum: torch.Tensor


def rl_objective(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    *,
    settings: RLSettings,
    ref_logps: torch.Tensor | None = None,
) -> ObjectiveTerms:
    """The loss terms of one micro-batch of completions, summed (see the module docstring for each objective).

    Args:
        logps: ``[n, T]`` the policy's log-probability of each completion token (with grad), 0 where ``mask`` is
            false.
        old_logps: ``[n, T]`` those of the policy that sampled (no grad).
        mask: ``[n, T]`` true at completion tokens.
        advantages: ``[n]``.
        settings: the objective.
        ref_logps: ``[n, T]`` the reference's, for the KL term (needed when ``settings.kl_coef`` is not 0).
    """
    mask = mask.to(logps.dtype)
    advantages = advantages.to(logps.dtype)[:, None]
    lengths = mask.sum(-1).clamp(min=1)
    low, high = 1.0 - settings.clip_low, 1.0 + settings.clip_high
    log_ratio = (logps - old_logps) * mask
    kl = torch.zeros_like(logps)
    if settings.kl_coef:
        if ref_logps is None:
            raise ValueError("kl_coef needs the reference's log-probabilities")
        delta = (ref_logps - logps) * mask
        kl = (torch.exp(delta) - delta - 1) * mask  # k3: ref/p - log(ref/p) - 1, an unbiased, positive KL estimate
    level = _LEVEL[settings.loss]
    if settings.loss == "gspo":
        ratio = torch.exp(log_ratio.sum(-1) / lengths)[:, None]  # [n, 1]: the sequence's ratio
        surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)[:, 0]
        terms = -surrogate + settings.kl_coef * kl.sum(-1) / lengths  # [n]
        clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
        return ObjectiveTerms(loss_sum=terms.sum(), clipped=clipped.sum().detach(), clip_units=len(terms),
                              kl_sum=kl.sum().detach(), ratio_sum=ratio.sum().detach())
    ratio = torch.exp(log_ratio)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    token_terms = (-surrogate + settings.kl_coef * kl) * mask  # [n, T]
    loss_sum = (token_terms.sum(-1) / lengths).sum() if level == "sequence" else token_terms.sum()
    clipped = (((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))) & mask.bool()
    return ObjectiveTerms(loss_sum=loss_sum, clipped=clipped.sum().detach(), clip_units=int(mask.sum()),
                          kl_sum=kl.sum().detach(), ratio_sum=(ratio * mask).sum().detach())


@dataclass
class RolloutBatch:
    """One micro-batch of sampled sequences, as trained.

    Attributes:
        tokens: ``[n, S]`` each prompt followed by its completion, right-padded.
        labels: ``[n, S]`` shifted labels: each completion token at the position that predicts it, the ignore index
            elsewhere (prompt, padding).
        advantages: ``[n]``.
        old_logps: ``[n, S]`` the sampling policy's log-probabilities at the labels (None: the first update's own,
            detached: the policy has not moved yet).
        ref_logps: ``[n, S]`` the reference's (None without a KL term).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return self.labels != CROSS_ENTROPY_IGNORE_INDEX


def rollout_batch(prompts: list[list[int]], completions: list[list[int]], advantages: list[float], *,
                  pad_id: int, seq_len: int | None = None) -> RolloutBatch:
    """Lay out sequences (prompt, then completion) and their labels, right-padded to the longest (or ``seq_len``)."""
    rows = [p + c for p, c in zip(prompts, completions)]
    width = seq_len or max(len(r) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), CROSS_ENTROPY_IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion, dtype=torch.long)
        if completion:  # position p predicts token p + 1: the completion from the prompt's last position on
            labels[i, len(prompt) - 1 : len(prompt) + len(completion) - 1] = torch.tensor(completion, dtype=torch.long)
    return RolloutBatch(tokens=tokens, labels=labels, advantages=torch.tensor(advantages, dtype=torch.float64))


def token_logprobs(
    model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor, *, num_output_chunks: int = 1,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each label's float32 log-probability under ``model`` (``[n, S]``, 0 at ignored positions), and with
    ``with_entropy`` the summed entropy of the next-token distribution over the labelled positions (no grad).

    The logits come in ``num_output_chunks`` sequence chunks from the model's forward (so that data-parallel wrappers
    gather the output weight as for any forward), and each chunk is upcast on its own."""
    chunks = model(tokens, num_output_chunks=num_output_chunks)
    mask = labels != CROSS_ENTROPY_IGNORE_INDEX
    pieces, entropy = [], torch.zeros((), device=tokens.device)
    start = 0
    for chunk in chunks:
        end = start + chunk.shape[1]
        chunk_labels, chunk_mask = labels[:, start:end], mask[:, start:end]
        logp = chunk.to(torch.promote_types(chunk.dtype, torch.float32)).log_softmax(-1)  # (float64 stays)
        pieces.append(logp.gather(-1, chunk_labels.clamp(min=0)[..., None])[..., 0] * chunk_mask)
        if with_entropy:
            with torch.no_grad():
                entropy += (-(logp.exp() * logp).sum(-1) * chunk_mask).sum()
        start = end
    return torch.cat(pieces, dim=1), (entropy if with_entropy else None)


@torch.no_grad()
def score_batches(score: nn.Module, batches: list[RolloutBatch], *, device: torch.device,
                  autocast: contextlib.AbstractContextManager | None = None,
                  num_output_chunks: int = 1) -> list[torch.Tensor]:
    """The label log-probabilities of every batch under ``score`` (a model or a reference), without grad."""
    out = []
    for batch in batches:
        progress("scoring rollouts")
        with autocast or contextlib.nullcontext():
            logps, _ = token_logprobs(score, batch.tokens.to(device), batch.labels.to(device),
                                      num_output_chunks=num_output_chunks)
        out.append(logps)
    return out


def rl_forward_backward(
    model: nn.Module,
    batches: list[RolloutBatch],
    *,
    settings: RLSettings,
    norm: float,
    device: torch.device,
    data_parallel_size: int,
    data_parallel_group: dist.ProcessGroup | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    num_output_chunks: int = 1,
    routing: RoutingRecord | None = None,
) -> StepResult:
    """Accumulate the gradient of the objective over this rank's micro-batches of one update.

    With ``routing`` (a mixture-of-experts model's :class:`~toolkit.modules.moe.RoutingRecord` of the pass that
    computed the old log-probabilities, one forward per micro-batch), each micro-batch's forward routes every token to
    the experts chosen then (routing replay: the ratio compares the same experts' outputs), and the metrics gain
    ``routing_agreement``, the share of those choices the router would make again now.

    Each micro-batch's summed terms are scaled by ``data_parallel_size / norm`` (``norm``: :func:`normalizer` of the
    global batch), which the gradient reduction's average turns into the global batch's objective; gradients are
    reduced only on the last micro-batch. The loss and the metrics (``clip_fraction``, ``kl``, ``entropy``,
    ``ratio_mean``) are those of the global batch (one all-reduce at the end)."""
    scale = data_parallel_size / norm
    # loss, clipped, clip units, kl, ratio, entropy, tokens: summed on the device, read once after the last micro-batch
    totals = torch.zeros(7, dtype=torch.float64, device=device)
    num_positions, agreement = 0, []
    for i, batch in enumerate(batches):
        progress("a micro-batch")
        tokens, labels = batch.tokens.to(device), batch.labels.to(device)
        num_positions += tokens.numel()
        with gradient_sync(model, enabled=i == len(batches) - 1):
            replay = replay_routing(model, routing, forward_index=i) if routing is not None else \
                contextlib.nullcontext()
            with autocast or contextlib.nullcontext(), replay as chosen:
                logps, entropy = token_logprobs(model, tokens, labels, num_output_chunks=num_output_chunks,
                                                with_entropy=True)
            if routing is not None:
                agreement.append(routing_agreement(routing[i : i + 1], chosen))
            old = batch.old_logps.to(device) if batch.old_logps is not None else logps.detach()
            ref = batch.ref_logps.to(device) if batch.ref_logps is not None else None
            terms = rl_objective(logps, old, labels != CROSS_ENTROPY_IGNORE_INDEX, batch.advantages.to(device),
                                 settings=settings, ref_logps=ref)
            scaled = terms.loss_sum * scale
            (grad_scaler.scale(scaled) if grad_scaler is not None else scaled).backward()
        parts = (terms.loss_sum.detach(), terms.clipped, torch.tensor(terms.clip_units, device=device), terms.kl_sum,
                 terms.ratio_sum, entropy, (labels != CROSS_ENTROPY_IGNORE_INDEX).sum())
        totals += torch.stack([part.to(torch.float64) for part in parts])
    totals = all_reduce_sum(totals, group=data_parallel_group).cpu()
    loss_sum, clipped, clip_units, kl_sum, ratio_sum, entropy_sum, num_tokens = totals.tolist()
    metrics = {
        "clip_fraction": clipped / max(clip_units, 1),
        "kl": kl_sum / max(num_tokens, 1),
        "entropy": entropy_sum / max(num_tokens, 1),
        "ratio_mean": ratio_sum / max(clip_units, 1),
    }
    if agreement:  # (the mean of the ranks' micro-batch means)
        mean = torch.tensor([sum(agreement) / len(agreement), 1.0], dtype=torch.float64, device=device)
        total, ranks = all_reduce_sum(mean, group=data_parallel_group).tolist()
        metrics["routing_agreement"] = total / ranks
    return StepResult(loss=loss_sum / norm, num_tokens=int(num_tokens), num_positions=num_positions, metrics=metrics)
