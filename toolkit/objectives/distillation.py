"""Knowledge distillation's training step and validation: a frozen teacher's distributions taught to a student, mixed
with the student's own cross-entropy, normalized exactly over the global batch's target tokens.

Per micro-batch the teacher runs first (without grad) and returns its final hidden states
(:meth:`~toolkit.modules.TransformerDecoder.forward` with ``return_hidden``); the student's forward then takes them
with the teacher's output weight (:class:`~toolkit.modules.distillation.DistillTargets`) and returns its
cross-entropy sum and the summed divergence to the teacher over the same target positions, both computed in chunks
of positions from hidden states and output weights, so neither model's logits exist whole. The step's loss is
``(1 - kd_ratio) * cross-entropy + kd_ratio * divergence``, each a mean over the global batch's target tokens.

Under FSDP2 the teacher's output weight is read after its forward, while its root unit (embedding, final norm,
output) is still gathered (``toolkit.parallel.apply_fsdp`` keeps the root gathered after forward).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.errors import UserError
from toolkit.modules.distillation import DistillTargets, check_divergence
from toolkit.parallel import gradient_sync, unwrap
from toolkit.training.attention_backend import batch_attention_mask
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.training.accumulation import gradient_scale, start_global_token_count
from toolkit.training.step import StepResult
from toolkit.training.validation import batches_in_step, idle_batch, scoring


@dataclass(frozen=True)
class DistillSettings:
    """The objective of a distillation run (config ``kd_loss``, ``kd_ratio``, ``temperature``, ``jsd_beta``)."""

    loss: str = "forward_kl"
    kd_ratio: float = 0.5
    temperature: float = 1.0
    jsd_beta: float = 0.5

    def __post_init__(self) -> None:
        check_divergence(self.loss, temperature=self.temperature, beta=self.jsd_beta)
        if not 0 <= self.kd_ratio <= 1:
            raise ValueError(f"kd_ratio must be in [0, 1], got {self.kd_ratio}")


def check_teacher(student: nn.Module, teacher: nn.Module) -> None:
    """One line naming what makes ``teacher`` unable to teach ``student`` (their vocabularies, an output layer the
    chunked projection cannot take), raised as a UserError before any weight is loaded."""
    s_vocab, t_vocab = student.token_embedding().num_embeddings, teacher.token_embedding().num_embeddings
    if s_vocab != t_vocab:
        raise UserError(
            f"teacher_model: its vocabulary has {t_vocab} tokens and the student's {s_vocab}; distillation compares "
            "their distributions token by token, so both need the same tokenizer"
        )
    for name, model in (("model", student), ("teacher_model", teacher)):
        if model.distill_weight() is None:
            raise UserError(f"{name}: distillation needs a plain output projection (no adapter on it, no NF4 or "
                            "float8 output layer); remove apply_lora_to_output")


def _targets(teacher: nn.Module, mb: dict[str, torch.Tensor], mask, settings: DistillSettings) -> DistillTargets:
    with torch.no_grad():
        hidden = teacher(mb["tokens"], mask=mask, input_pos=mb.get("input_pos"), return_hidden=True)
    plain = unwrap(teacher)
    return DistillTargets(hidden=hidden, weight=plain.fused_loss_weight(), softcap=plain.final_logit_softcap,
                          kind=settings.loss, temperature=settings.temperature, beta=settings.jsd_beta)


def distill_forward_backward(
    model: nn.Module,
    teacher: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    settings: DistillSettings,
    device: torch.device,
    data_parallel_size: int,
    data_parallel_group: dist.ProcessGroup | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    num_output_chunks: int | None = None,
    flex_attention: bool = False,
) -> StepResult:
    """Accumulate the gradients of one global batch's share on this rank (see the module docstring); as
    :func:`~toolkit.training.forward_backward` for the normalization, the gradient sync and fp16's scaler.

    Returns:
        the step's loss (the mixed mean), its target tokens, this rank's positions, and in ``metrics`` the two
        parts, ``ce_loss`` and ``kd_loss`` (means over the global batch's target tokens).
    """
    wait_for_token_count = start_global_token_count([mb["labels"] for mb in micro_batches], group=data_parallel_group)
    num_tokens = scale = None
    sums = torch.zeros(2, device=device, dtype=torch.float64)  # [cross-entropy, divergence]
    num_positions = 0
    alpha = settings.kd_ratio
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        num_positions += mb["tokens"].numel()
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast or contextlib.nullcontext():
                mask = batch_attention_mask(mb, flex_attention=flex_attention)
                targets = _targets(teacher, mb, mask, settings)
                ce, kd = model(mb["tokens"], mask=mask, input_pos=mb.get("input_pos"), labels=mb["labels"],
                               num_output_chunks=num_output_chunks, distill=targets)
            if scale is None:
                num_tokens = wait_for_token_count()
                scale = gradient_scale(global_tokens=num_tokens, data_parallel_size=data_parallel_size)
            scaled = ((1 - alpha) * ce + alpha * kd) * scale
            (grad_scaler.scale(scaled) if grad_scaler is not None else scaled).backward()
        sums += torch.stack([ce.detach(), kd.detach()]).double()
    ce_mean, kd_mean = (all_reduce_sum(sums, group=data_parallel_group) / max(num_tokens, 1)).tolist()
    return StepResult(
        loss=(1 - alpha) * ce_mean + alpha * kd_mean, num_tokens=num_tokens, num_positions=num_positions,
        metrics={"ce_loss": ce_mean, "kd_loss": kd_mean},
    )


@torch.no_grad()
def distill_validation(
    model: nn.Module,
    teacher: nn.Module,
    loader,
    *,
    settings: DistillSettings,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
    flex_attention: bool = False,
    num_output_chunks: int | None = None,
    data_parallel_group: dist.ProcessGroup | None = None,
) -> dict[str, float | int]:
    """The student's cross-entropy and divergence to the teacher over a whole held-out set, each rank scoring its
    slice (:class:`~toolkit.training.ValidationSampler`), summed exactly over the ranks: ``val_loss`` (the
    cross-entropy), ``val_kd_loss`` and ``val_tokens``. A collective (ranks out of batches run idle forwards of
    both models, so sharded layers gather in step); the models return to their modes afterwards."""
    plain = unwrap(model)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with scoring(plain, teacher):
        for mb, _ in batches_in_step(loader, device=device, idle=idle_batch(device)):
            with autocast or contextlib.nullcontext():
                mask = batch_attention_mask(mb, flex_attention=flex_attention)
                targets = _targets(teacher, mb, mask, settings)
                ce, kd = plain(mb["tokens"], mask=mask, input_pos=mb.get("input_pos"), labels=mb["labels"],
                               num_output_chunks=num_output_chunks, distill=targets)
            count = (mb["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum()
            sums += torch.stack([ce.double(), kd.double(), count.double()])
    ce_sum, kd_sum, count = all_reduce_sum(sums, group=data_parallel_group).tolist()
    if count == 0:
        raise UserError("validation: the dataset has no target tokens (every label is ignored); nothing to score")
    return {"val_loss": ce_sum / count, "val_kd_loss": kd_sum / count, "val_tokens": int(count)}
