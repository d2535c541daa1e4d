"""Knowledge-distillation losses between a student's and a teacher's next-token distributions, computed from both
models' final hidden states and output weights in chunks of positions, so that neither model's logits exist whole.

Per target position, with the student's logits ``s`` and the teacher's ``t`` over the same vocabulary, both divided
by a temperature ``T``, ``p = softmax(s / T)`` and ``q = softmax(t / T)``:

- ``forward_kl``: ``KL(q || p) = sum q (log q - log p)``, the classic distillation loss (Hinton et al., 2015,
  https://arxiv.org/abs/1503.02531, Sec. 2: the cross-entropy to the soft targets, minus the teacher's entropy,
  which has no gradient); mode-covering.
- ``reverse_kl``: ``KL(p || q) = sum p (log p - log q)``, mode-seeking (as in MiniLLM, Gu et al., 2024,
  https://arxiv.org/abs/2306.08543, Eq. 1, here token by token on fixed sequences).
- ``jsd``: the generalized Jensen-Shannon divergence of GKD (Agarwal et al., 2024, https://arxiv.org/abs/2306.13649,
  Eq. 4) with ``beta`` in ``(0, 1)``: ``beta KL(q || m) + (1 - beta) KL(p || m)``, ``m = beta q + (1 - beta) p``.

Each is multiplied by ``T^2`` (Hinton et al., Sec. 2.1: the soft targets' gradients scale as ``1 / T^2``, so the
loss keeps its weight against the cross-entropy whatever the temperature).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from toolkit.modules.loss import local_vocab_shard

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True)
class DistillTargets:
    """What a student's forward distills from (:meth:`~toolkit.modules.TransformerDecoder.forward`'s
    ``distill``): the teacher's final hidden states ``[b, s, d_teacher]`` for the same tokens, its output weight
    ``[vocab, d_teacher]`` and logit soft-cap, and the divergence (see :func:`linear_distillation_sum`)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    softcap: float | None = None
    kind: str = "forward_kl"
    temperature: float = 1.0
    beta: float = 0.5


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    kind: str,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Per position (``[m]``, float32) the divergence ``kind`` (module docstring) between the student's and the
    teacher's distributions from their logits ``[m, vocab]``, times ``temperature^2``."""
    log_p = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return _divergence(log_p, log_q, kind=kind, beta=beta) * temperature**2


def _divergence(log_p: torch.Tensor, log_q: torch.Tensor, *, kind: str, beta: float) -> torch.Tensor:
    # Summed over the columns given: the whole vocabulary, or under tensor parallelism this rank's share of it.
    if kind == "forward_kl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if kind == "reverse_kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "jsd":
        # log m = logsumexp(log beta + log q, log(1 - beta) + log p), stable where either is tiny.
        log_m = torch.logaddexp(log_q + math.log(beta), log_p + math.log1p(-beta))
        return beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * (log_p.exp() * (log_p - log_m)).sum(-1)
    raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")


# --- Under tensor parallelism: each rank holds a shard of the vocabulary ---------------------------------------------
#
# Both models' output weights are split over the vocabulary (their rows) the same way, so each rank projects its
# columns of both logits. The divergence is a sum over the vocabulary of terms that need, besides a column's own
# logits, only each row's log-sum-exp over the whole vocabulary: two reductions over the group per model (the row
# maxima, then the sums of exponentials, 2 m floats each), after which every rank sums its columns' terms. That
# partial sum is what each rank differentiates: the total is the sum of the ranks' partials, so a column's gradient
# comes from its own rank's terms, plus, through the log-sum-exp, every rank's (the sum's backward all-reduces its
# gradient); the student's hidden states, shared by the ranks, get the sum of the ranks' gradients.


class _SumOverGroup(torch.autograd.Function):
    """``all_reduce(x)`` over ``group``, whose gradient is the sum of the ranks' gradients: the reduced value feeds
    each rank's partial loss, and the total loss is the sum of those."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SharedAcrossGroup(torch.autograd.Function):
    """The identity on a tensor every rank of ``group`` holds the same (the student's hidden states), whose
    gradient is the sum of the ranks' gradients (each rank's comes from its own columns only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _vocab_parallel_log_softmax(logits: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's columns of the log-softmax of rows split by columns over ``group`` (float32 ``[m, v_local]``)."""
    row_max = logits.detach().amax(dim=-1)
    dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)  # a constant shift: no gradient
    shifted = logits - row_max.unsqueeze(-1)
    return shifted - _SumOverGroup.apply(shifted.exp().sum(-1), group).log().unsqueeze(-1)


def check_divergence(kind: str, *, temperature: float, beta: float) -> None:
    """Raises ValueError naming the option that :func:`token_divergence` cannot take."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; choose one of {', '.join(DIVERGENCES)}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if kind == "jsd" and not 0 < beta < 1:
        raise ValueError(f"jsd's beta must be in (0, 1), got {beta}")


def _chunk_divergence_sum(
    student_h: torch.Tensor, student_weight: torch.Tensor, teacher_h: torch.Tensor, teacher_weight: torch.Tensor,
    kind: str, temperature: float, beta: float, student_softcap: float | None, teacher_softcap: float | None,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    if group is not None:
        student_h = _SharedAcrossGroup.apply(student_h, group)
    student_logits = student_h @ student_weight.T
    if student_softcap is not None:
        student_logits = torch.tanh(student_logits / student_softcap) * student_softcap
    with torch.no_grad():
        teacher_logits = teacher_h @ teacher_weight.T
        if teacher_softcap is not None:
            teacher_logits = torch.tanh(teacher_logits / teacher_softcap) * teacher_softcap
    if group is None:
        return token_divergence(student_logits, teacher_logits, kind=kind, temperature=temperature, beta=beta).sum()
    log_p = _vocab_parallel_log_softmax(student_logits.float() / temperature, group)
    with torch.no_grad():
        log_q = _vocab_parallel_log_softmax(teacher_logits.float() / temperature, group)
    return _divergence(log_p, log_q, kind=kind, beta=beta).sum() * temperature**2  # this rank's columns' share


def linear_distillation_sum(
    student_h: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_h: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    kind: str = "forward_kl",
    temperature: float = 1.0,
    beta: float = 0.5,
    num_chunks: int = 1,
    student_softcap: float | None = None,
    teacher_softcap: float | None = None,
) -> torch.Tensor:
    """The summed divergence (float32 scalar) over ``t`` positions between the student's distributions,
    ``student_h @ student_weight.T`` (``[t, d]`` and ``[vocab, d]``), and the teacher's, ``teacher_h @
    teacher_weight.T`` (``[t, d_teacher]`` and ``[vocab, d_teacher]``), each optionally soft-capped.

    The positions are taken in ``num_chunks`` chunks, each a checkpointed function: its two ``[t / num_chunks,
    vocab]`` logit blocks exist only while it runs, in forward and again in backward (the teacher's projection is
    recomputed there, without grad), so at most one chunk's logits of each model are held, never a whole
    sequence's. Only the student's side takes gradients.

    Under tensor parallelism both weights are DTensors split alike over the vocabulary (their rows, on the TP
    mesh), the hidden states the same on every rank of it: each rank projects its columns only and the sum is
    reduced over the group (see the comment above :class:`_SumOverGroup`), the same on every rank; every rank of
    the group must call it with the same arguments.

    Raises:
        ValueError: the vocabularies differ, the rows do not match, or a bad ``kind``, ``temperature`` or ``beta``.
    """
    check_divergence(kind, temperature=temperature, beta=beta)
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"the teacher's vocabulary ({teacher_weight.shape[0]} tokens) differs from the student's "
            f"({student_weight.shape[0]}): distillation compares their distributions token by token"
        )
    if student_h.shape[0] != teacher_h.shape[0]:
        raise ValueError(f"{student_h.shape[0]} student positions against {teacher_h.shape[0]} teacher positions")
    student_weight, student_shard = local_vocab_shard(student_weight)  # differentiable: gradients reach the DTensor
    teacher_weight, teacher_shard = local_vocab_shard(teacher_weight)
    where = [(shard.start, shard.size) if shard is not None else None for shard in (student_shard, teacher_shard)]
    if where[0] != where[1]:
        raise ValueError("the student's and the teacher's output weights must be split over the vocabulary alike")
    group = student_shard.group if student_shard is not None else None
    total = student_h.new_zeros((), dtype=torch.float32)
    for s_rows, t_rows in zip(student_h.tensor_split(num_chunks), teacher_h.tensor_split(num_chunks)):
        if s_rows.shape[0] == 0:
            continue
        args = (s_rows, student_weight, t_rows, teacher_weight, kind, temperature, beta, student_softcap,
                teacher_softcap, group)
        if torch.is_grad_enabled() and (s_rows.requires_grad or student_weight.requires_grad):
            total = total + checkpoint(_chunk_divergence_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_divergence_sum(*args)
    if group is None:
        return total
    # The whole sum on every rank; its gradient, each rank's own share's (see above).
    whole = total.detach().clone()
    dist.all_reduce(whole, group=group)
    return total + (whole - total.detach())
