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

``kto`` (:mod:`toolkit.objectives.kto`) learns from answers judged one at a time rather than from pairs; its held-out
pairs are scored here as ``dpo``'s, with the same implicit reward.
"""

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from toolkit.data.labels import CROSS_ENTROPY_IGNORE_INDEX
from toolkit.errors import UserError
from toolkit.modules.peft import disable_adapters
from toolkit.parallel import ParallelDims, apply_data_parallel, apply_ep, apply_tp, gradient_sync, unwrap
from toolkit.training.attention_backend import batch_attention_mask
from toolkit.parallel.distributed import all_reduce_sum
from toolkit.training.init import materialize
from toolkit.planning.memory import StepKernels
from toolkit.checkpoint.output_dir import REFERENCE_LOGPS_FILE
from toolkit.training.step import StepResult, taken_routing_metrics
from toolkit.training.validation import ValidationSampler, batches_in_step, idle_batch, scoring

PAIR_LOSSES = ("dpo", "ipo", "simpo", "orpo")
LOSSES = (*PAIR_LOSSES, "kto")  # kto: toolkit.objectives.kto, on unpaired answers
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
    """The per-pair losses of ``kind`` (one of :data:`PAIR_LOSSES`, see the module docstring) and the implicit
    rewards.

    Raises:
        ValueError: an unknown ``kind``, ``beta`` not positive, ``label_smoothing`` outside ``[0, 0.5)``, or a
            reference missing for ``dpo``/``ipo`` (or given to a reference-free loss).
    """
    if kind not in PAIR_LOSSES:
        raise ValueError(f"unknown pair loss {kind!r}; choose one of {', '.join(PAIR_LOSSES)}")
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
    """The loss of a preference run (``preference_loss``, ``beta``...: see :func:`preference_losses`, and for
    ``kto``, whose answers have weights by kind, :func:`~toolkit.objectives.kto.kto_losses`)."""

    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def pair_loss(self) -> str:
        """The loss held-out pairs are scored with: the run's own, or for ``kto``, ``dpo`` (the same reward)."""
        return "dpo" if self.loss == "kto" else self.loss

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


def preference_kernels(kernels: StepKernels, *, loss: str, adapters: bool, precompute: bool) -> StepKernels:
    """What the memory plan counts for a preference step (:class:`~toolkit.planning.StepKernels`): each pair is two
    rows of one forward (a KTO sample, one answer: its KL sequence is scored apart, without grad), and a full
    fine-tune with a live reference (not ``precompute``d, for a loss that has one) holds a frozen copy of the model
    (:func:`frozen_reference`); adapters' reference is their own base."""
    live_copy = loss not in REFERENCE_FREE and not adapters and not precompute
    return dataclasses.replace(kernels, sequences_per_sample=1 if loss == "kto" else 2, reference_model=live_copy)


# The metrics of a step, means over the pairs of the global batch (metrics.jsonl's names).
METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected")


class Reference:
    """The reference model as the step calls it: ``reference(tokens, **inputs)`` scores like ``module`` without
    grad, with the adapters switched off if ``adapters_off`` (:func:`lora_reference`). ``module`` is what runs, so
    that what is left gathered after forwards without a backward can be freed."""

    def __init__(self, module: nn.Module, *, adapters_off: bool = False) -> None:
        self.module, self.adapters_off = module, adapters_off

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        off = disable_adapters(unwrap(self.module)) if self.adapters_off else contextlib.nullcontext()
        with torch.no_grad(), off:
            return self.module(*args, **kwargs)


def lora_reference(model: nn.Module) -> Reference:
    """The reference of a LoRA/DoRA policy: its base, the adapters switched off (no second copy in memory)."""
    return Reference(model, adapters_off=True)


def frozen_reference(
    build: Callable[[], nn.Module],
    *,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    device: torch.device,
    dtype: torch.dtype,
    fill: Callable[[nn.Module], None],
    sequence_parallel: bool = False,
) -> nn.Module:
    """The reference of a full fine-tune: a frozen copy of the policy's starting weights, laid out like the policy.

    ``build()`` makes the model on the meta device, ``fill(model)`` loads (or initializes) its weights. It is split
    over the mesh as the policy is (tensor and expert parallel; FSDP2 over the data-parallel ranks for the sharded
    strategies, resharding after every forward, ZeRO-2 too, since no backward follows), and stored in ``dtype``,
    the compute dtype: it is never updated, so it needs no float32 master copy. Under ddp and zero1 every rank holds
    it whole, as it holds the policy. It is in eval mode and needs no gradient.
    """
    with torch.device("meta"):
        reference = build()
    reference.requires_grad_(False)
    if dims.tp > 1:
        apply_tp(reference, tp_mesh=mesh["tp"], sequence_parallel=sequence_parallel)
    if dims.ep > 1:
        apply_ep(reference, ep_mesh=mesh["ep"])
    # As parallelize orders it: split on the meta device where it can, so each rank only allocates its part;
    # offloaded shards are made from whole weights.
    shard_first = dims.tp > 1 or dims.ep > 1 or (dims.is_sharded and not dims.cpu_offload)
    fsdp_dims = dataclasses.replace(dims, strategy="zero3") if dims.strategy == "zero2" else dims

    def shard(module: nn.Module) -> nn.Module:
        return apply_data_parallel(module, dims=fsdp_dims, device=device, mesh=mesh) if dims.is_sharded else module

    if shard_first:
        reference = shard(reference.to(dtype))
        materialize(reference, device=device)
    else:
        materialize(reference, device=device, dtype=dtype)
    fill(reference)
    if not shard_first:
        reference = shard(reference)
    return reference.eval()


def model_reference(reference: nn.Module) -> Reference:
    """A frozen reference model (:func:`frozen_reference`), or the policy before its first step, as the step calls
    it."""
    return Reference(reference)


def pair_inputs(mb: dict[str, torch.Tensor], *, flex_attention: bool) -> dict:
    """The model's keyword arguments for scoring ``mb``'s rows: each row's summed log-probability of its labels."""
    return dict(mask=batch_attention_mask(mb, flex_attention=flex_attention), input_pos=mb.get("input_pos"),
                labels=mb["labels"], lengths=mb.get("lengths"), per_sequence=True)


def score_pairs(
    model: nn.Module,
    mb: dict[str, torch.Tensor],
    *,
    settings: PreferenceSettings,
    reference: Reference | None,
    flex_attention: bool = False,
) -> tuple[PairLogprobs, PairLosses]:
    """One micro-batch of ``b`` pairs (``2b`` rows on the device: chosen, then rejected) scored in one forward: the
    policy's per-pair log-probabilities and the per-pair losses (the reference from ``reference``, else from the
    batch's ``ref_logps``; none for a reference-free loss). Call it inside the step's autocast."""
    half = mb["labels"].shape[0] // 2
    inputs = pair_inputs(mb, flex_attention=flex_attention)
    logps = model(mb["tokens"], **inputs)  # [2b]
    counts = (mb["labels"] != CROSS_ENTROPY_IGNORE_INDEX).sum(dim=1).float()
    policy = PairLogprobs(logps[:half], logps[half:], counts[:half], counts[half:])
    ref = None
    if settings.needs_reference:
        ref_logps = (mb["ref_logps"] if reference is None else reference(mb["tokens"], **inputs)).float()
        ref = PairLogprobs(ref_logps[:half], ref_logps[half:], counts[:half], counts[half:])
    losses = preference_losses(
        settings.pair_loss, policy, ref, beta=settings.beta, label_smoothing=settings.label_smoothing,
        simpo_gamma=settings.simpo_gamma,
    )
    return policy, losses


def _pair_totals(loss_sum: torch.Tensor, policy: PairLogprobs, out: PairLosses) -> torch.Tensor:
    """The sums behind :data:`METRICS` (and the loss) over a micro-batch's pairs, float64. A tie between the
    rewards counts half, so a policy that is still its reference scores chance, 0.5."""
    wins = (out.rewards_chosen > out.rewards_rejected).double() + 0.5 * (out.rewards_chosen == out.rewards_rejected)
    return torch.stack([
        loss_sum.detach().double(), out.rewards_chosen.double().sum(), out.rewards_rejected.double().sum(),
        (out.rewards_chosen - out.rewards_rejected).double().sum(), wins.sum(),
        policy.chosen.detach().double().sum(), policy.rejected.detach().double().sum(),
    ])


def preference_forward_backward(
    model: nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    *,
    settings: PreferenceSettings,
    device: torch.device,
    data_parallel_size: int,
    data_parallel_group: dist.ProcessGroup | None = None,
    reference: Reference | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    flex_attention: bool = False,
) -> StepResult:
    """Accumulate the gradients of one global batch's share of preference pairs on this rank.

    Each micro-batch holds ``b`` pairs as ``2b`` rows (:func:`~toolkit.data.preference_collate`: the chosen answers,
    then the rejected ones), scored in one forward (:meth:`~toolkit.modules.TransformerDecoder.forward` with
    ``per_sequence=True``: summed log-probabilities of each row's trained tokens, the fused projection keeping no
    logits). The reference's log-probabilities come from ``reference`` (called as the model is, without grad:
    :func:`lora_reference`, :func:`model_reference`), or, where the batch carries them (``ref_logps`` ``[2b]``,
    :func:`precompute_reference_logps`), from the batch; reference-free losses take none. The global count of pairs
    (and, for ORPO, of chosen tokens) is taken first, so every micro-batch adds its pairs' losses divided by the
    global pairs: the accumulated, reduced gradient is the mean over every pair, whatever the split into ranks and
    micro-steps. ``grad_scaler`` (fp16) scales each backward, as :func:`~toolkit.training.forward_backward` does.

    Returns:
        the step's loss (the mean over the global batch's pairs, ORPO's supervised term included), its trained
        tokens (chosen and rejected), this rank's positions, and in ``metrics`` :data:`METRICS` (means over the
        global batch's pairs) and ``pairs``.
    """
    counts = torch.zeros(3, dtype=torch.float64)
    for mb in micro_batches:
        half = mb["labels"].shape[0] // 2
        trained = mb["labels"] != CROSS_ENTROPY_IGNORE_INDEX
        counts += torch.tensor([half, int(trained[:half].sum()), int(trained.sum())])
    global_pairs, global_chosen_tokens, global_tokens = (
        int(v) for v in all_reduce_sum(counts, group=data_parallel_group))
    totals = torch.zeros(len(METRICS) + 1, dtype=torch.float64, device=device)
    num_positions = 0
    plain = unwrap(model)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
        num_positions += mb["tokens"].numel()
        with gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with autocast or contextlib.nullcontext():
                policy, out = score_pairs(model, mb, settings=settings, reference=reference,
                                          flex_attention=flex_attention)
            loss = out.loss.sum() / global_pairs
            if settings.loss == "orpo":  # its supervised term: the chosen answers' mean token cross-entropy
                loss = loss - policy.chosen.sum() / max(global_chosen_tokens, 1)
            router_loss = plain.take_router_loss() if hasattr(plain, "take_router_loss") else None
            if router_loss is not None:  # mixture of experts: the load-balancing loss, a mean over the batch's rows
                loss = loss + router_loss / (2 * global_pairs)
            scaled = loss * data_parallel_size  # (the gradient reduction averages over the ranks)
            (grad_scaler.scale(scaled) if grad_scaler is not None else scaled).backward()
        totals += _pair_totals(loss * global_pairs, policy, out)
    totals = all_reduce_sum(totals, group=data_parallel_group).cpu() / max(global_pairs, 1)
    routed = taken_routing_metrics(plain, num_tokens=2 * global_pairs, group=data_parallel_group)
    return StepResult(
        loss=float(totals[0]), num_tokens=global_tokens, num_positions=num_positions,
        metrics={**dict(zip(METRICS, totals[1:].tolist())), "pairs": global_pairs, **routed},
    )


@torch.no_grad()
def preference_validation(
    model: nn.Module,
    loader: DataLoader,
    *,
    settings: PreferenceSettings,
    device: torch.device,
    reference: Reference | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    flex_attention: bool = False,
    data_parallel_group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The preference loss and metrics over a whole held-out set of pairs, each rank scoring its slice
    (:class:`~toolkit.training.ValidationSampler`), summed exactly over the ranks: ``val_loss`` (without ORPO's
    supervised term), ``val_<metric>`` for each of :data:`METRICS` (``val_reward_accuracy``: the held-out preference
    accuracy, ties counting half), and ``val_pairs``. A collective; the model returns to its mode afterwards."""
    plain = unwrap(model)
    totals = torch.zeros(len(METRICS) + 2, dtype=torch.float64, device=device)
    references = [reference.module] if reference is not None else []
    with scoring(plain, *references):
        for mb, real in batches_in_step(loader, device=device, idle=idle_batch(device, rows=2)):
            with autocast or contextlib.nullcontext():
                if not real:  # forwards only, so sharded layers' gathers stay in step
                    plain(mb["tokens"], **pair_inputs(mb, flex_attention=flex_attention))
                    if reference is not None and settings.needs_reference:
                        reference(mb["tokens"], **pair_inputs(mb, flex_attention=flex_attention))
                    continue
                policy, out = score_pairs(plain, mb, settings=settings, reference=reference,
                                          flex_attention=flex_attention)
            pairs = torch.tensor([policy.chosen.numel()], dtype=torch.float64, device=device)
            totals += torch.cat([_pair_totals(out.loss.sum(), policy, out), pairs])
    totals = all_reduce_sum(totals, group=data_parallel_group).cpu()
    pairs = float(totals[-1])
    if pairs == 0:
        raise UserError("validation: the preference set has no pairs; nothing to score")
    means = (totals[:-1] / pairs).tolist()
    return {"val_loss": means[0], **{f"val_{name}": v for name, v in zip(METRICS, means[1:])}, "val_pairs": int(pairs)}


# --- Reference log-probabilities computed once ---------------------------------------------------------------------

REFERENCE_FILE = REFERENCE_LOGPS_FILE  # in output_dir: a run file (overwrite=true clears it)


class WithReferenceLogps(Dataset):
    """A preference dataset whose samples also carry the reference's summed log-probabilities of their two
    sequences (``ref_logps``: chosen and rejected, or KTO's answer and KL sequence), which
    :func:`~toolkit.data.preference_collate` batches."""

    def __init__(self, dataset: Dataset, logps: torch.Tensor) -> None:
        if logps.shape != (len(dataset), 2):
            raise ValueError(f"reference log-probabilities of shape {tuple(logps.shape)} for {len(dataset)} pairs")
        self.dataset, self.logps = dataset, logps

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        return {**self.dataset[index], "ref_logps": self.logps[index].tolist()}


@torch.no_grad()
def precompute_reference_logps(
    reference: Reference,
    dataset: Dataset,
    collate: Callable[[list], dict[str, torch.Tensor]],
    *,
    batch_size: int,
    device: torch.device,
    dp_rank: int = 0,
    dp_size: int = 1,
    data_parallel_group: dist.ProcessGroup | None = None,
    autocast: contextlib.AbstractContextManager | None = None,
    flex_attention: bool = False,
) -> torch.Tensor:
    """The reference's summed log-probabilities of every pair's chosen and rejected answers, ``[pairs, 2]`` float32
    on the host, on every rank. Each data-parallel rank scores its contiguous slice
    (:class:`~toolkit.training.ValidationSampler`) in batches of ``batch_size`` pairs and the slices are summed
    into the whole over ``data_parallel_group``; a collective (ranks out of batches run idle forwards, so sharded
    layers gather in step)."""
    sampler = ValidationSampler(len(dataset), rank=dp_rank, world_size=dp_size)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate)
    out = torch.zeros(len(dataset), 2, dtype=torch.float64, device=device)
    start = sampler.start
    with scoring(reference.module):
        for mb, real in batches_in_step(loader, device=device, idle=idle_batch(device, rows=2),
                                        label="reference log-probabilities"):
            with autocast or contextlib.nullcontext():
                logps = reference(mb["tokens"], **pair_inputs(mb, flex_attention=flex_attention)).double()
            if real:
                half = logps.shape[0] // 2
                out[start : start + half] = torch.stack([logps[:half], logps[half:]], dim=1)
                start += half
    return all_reduce_sum(out, group=data_parallel_group).float().cpu()


def reference_logps_file(dataset: Dataset, *, output_dir: Path, fingerprint: str) -> Path:
    """Where the precomputed reference of ``dataset`` is kept: beside its tokenized data when it came from the
    dataset cache (and the cache can be written), ``reference_logps-<hash of fingerprint>.safetensors`` in its
    store's folder, so that every run on the same data from the same starting model reads it (a sweep over
    ``beta`` computes it once); else in ``output_dir`` (``reference_logps.safetensors``, a run file)."""
    folder = getattr(getattr(dataset, "store", None), "path", None)
    if folder is not None and os.access(folder, os.W_OK):
        digest = hashlib.sha256(fingerprint.encode("utf-8")).hexdigest()[:16]
        return Path(folder) / f"reference_logps-{digest}.safetensors"
    return output_dir / REFERENCE_FILE


def save_reference_logps(path: Path, logps: dict[str, torch.Tensor], *, fingerprints: dict[str, str]) -> None:
    """Write precomputed references (:func:`precompute_reference_logps`), by dataset name (``train``,
    ``validation``), to ``path`` (safetensors, written aside and renamed, so that a run reading it meanwhile sees
    the old file or the new), each with the ``fingerprints[name]`` of what it was computed from."""
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    save_file({name: t.contiguous() for name, t in logps.items()}, str(tmp),
              metadata={f"fingerprint.{name}": fingerprints[name] for name in logps})
    tmp.replace(path)


def load_reference_logps(path: Path, *, name: str, num_pairs: int, fingerprint: str) -> torch.Tensor | None:
    """The precomputed reference of dataset ``name`` at ``path`` if it was computed from the same ``fingerprint``
    for ``num_pairs`` pairs; None if there is none or it is another's (it is then computed again). Only tensors are
    read (safetensors): nothing in the file runs."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get(f"fingerprint.{name}") != fingerprint or name not in f.keys():
                return None
            logps = f.get_tensor(name)
    except Exception:  # noqa: BLE001 (damaged, or not safetensors: computed again)
        return None
    if logps.shape != (num_pairs, 2) or logps.dtype != torch.float32 or not torch.isfinite(logps).all():
        return None
    return logps
