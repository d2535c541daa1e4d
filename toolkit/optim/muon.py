"""Muon for the hidden matrices and AdamW for everything else, in one optimizer, exact on every data-parallel layout.

Muon (Jordan et al., 2024) keeps one momentum buffer per matrix and steps along an orthogonalized version of it: a
few Newton-Schulz iterations push every singular value of the (Nesterov) momentum towards 1. The arithmetic of one
matrix here is exactly that of ``torch.optim.Muon`` (PyTorch >= 2.9): the momentum ``lerp``, the iteration in
bfloat16 with the same coefficients and order of operations, the decoupled weight decay and the shape-based
learning-rate adjustment (``adjust_lr_fn``). Parameters Muon does not fit (the token embedding, the output
projection, the MoE router, norms, biases, DoRA magnitudes; by default LoRA's adapters too) are stepped by torch's
own AdamW kernel (``torch.optim.adam.adam`` with decoupled weight decay), each group with its own learning rate and
weight decay. Stacked expert weights ``[experts, out, in]`` are orthogonalized per expert, in one batched iteration.

Orthogonalizing needs the whole matrix, which no rank has under a sharded layout; orthogonalizing each rank's shard
would be a different (wrong) update. How each layout gets the update torch's Muon computes for the same gradient:

=============  ====================================================================================================
one process    every matrix orthogonalized where it is
``ddp``        gradients and momentum are whole on every rank; each matrix has an owner (greedy, balanced by size)
               that alone orthogonalizes it, and the results are all-gathered (bucketed, in the iteration's dtype),
               so each rank does 1/world of the work (:meth:`Muon.share_orthogonalization`, which
               :func:`~toolkit.parallel.shard_optimizer_state` calls)
``zero1``      ZeroRedundancyOptimizer gives each rank whole parameters to step, with their state: the inner Muon
               orthogonalizes only those, and ZeRO broadcasts the updated parameters
``zero2/3``,   the parameters are FSDP2 shards (row blocks of each matrix); the momentum stays sharded like its
``hsdp``       parameter. Each matrix has an owner in the shard group: one all-to-all (per bucket) brings it every
               rank's rows of the update (in the iteration's dtype, the first thing the iteration casts to), it
               assembles and orthogonalizes the whole matrix, and a second all-to-all returns each rank its rows.
               Under HSDP every replica group does the same in parallel.
=============  ====================================================================================================

Tensor- and expert-parallel parameters (split on more than the rows of one mesh dimension) are refused with one
line (the config check refuses the layout before launch).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

# torch.optim.Muon's defaults (Keller Jordan's quintic coefficients and five steps).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_FNS = ("original", "match_rms_adamw")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
# Modules whose matrices are not hidden layers: the token embedding (independent rows), the output projection and
# the MoE router (the rows are classes: orthogonalizing them mixes the classes' updates).
NOT_HIDDEN = ("embed_tokens", "output", "lm_head", "router")
ADAPTERS = ("lora_a", "lora_b")
# Whole matrices of one exchange at most (bytes in the iteration's dtype): bounds the transient buffers of a step.
BUCKET_BYTES = 256 * 1024**2


def orthogonalize(
    update: Tensor, *, coefficients: Sequence[float] = NS_COEFFICIENTS, steps: int = NS_STEPS, eps: float = NS_EPS,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """The Newton-Schulz orthogonalization of ``update`` ``[rows, cols]``, or of each matrix of ``[n, rows, cols]``,
    in ``dtype``: for a matrix in bfloat16, the operations of ``torch.optim.Muon`` one by one (the same values)."""
    a, b, c = coefficients
    x = update.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's learning rate for a matrix of ``shape`` (the last two dimensions: one expert's): ``original``
    (the default) scales by sqrt(max(1, rows / cols)), ``match_rms_adamw`` by 0.2 sqrt(max(rows, cols)), which gives
    updates AdamW's RMS so that AdamW's learning rate and weight decay carry over."""
    rows, cols = shape[-2], shape[-1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


# --- which parameters Muon steps ---------------------------------------------------------------------------------------


def _not_a_matrix(name: str, param: Tensor) -> str | None:
    """Why Muon cannot step ``param``, or None."""
    if param.ndim < 2:
        return f"a {param.ndim}-D parameter (Muon steps matrices)"
    if param.ndim > 3:
        return f"a {param.ndim}-D parameter (Muon steps matrices and stacks of expert matrices)"
    modules = name.split(".")[:-1]
    hidden = next((m for m in modules if m in NOT_HIDDEN), None)
    if hidden is not None and not any(m in ADAPTERS for m in modules):
        return f"the {hidden} matrix, whose rows are tokens or classes, not a hidden layer (AdamW trains it)"
    return None


def muon_by_default(name: str, param: Tensor, *, adapters: bool) -> bool:
    """Whether Muon steps ``param`` when the config lists no ``muon_params``: every hidden matrix (attention and MLP
    projections, stacked experts), LoRA's A and B only with ``adapters``, never the embedding, output or router
    (nor adapters on them)."""
    modules = name.split(".")[:-1]
    if _not_a_matrix(name, param) is not None or any(m in NOT_HIDDEN for m in modules):
        return False
    return adapters or not any(m in ADAPTERS for m in modules)


def split_parameters(
    named: Sequence[tuple[str, Tensor]], *, muon_params: Sequence[str] | None, adapters: bool
) -> tuple[list[Tensor], list[Tensor]]:
    """``named`` parameters split into Muon's and AdamW's.

    Raises:
        ValueError: a ``muon_params`` pattern that matches a parameter Muon cannot step, or no parameter at all.
    """
    if not named:  # (nothing to choose from: a config checked without its model)
        return [], []
    if muon_params is None:
        chosen = [muon_by_default(name, p, adapters=adapters) for name, p in named]
    else:
        chosen = [False] * len(named)
        for pattern in muon_params:
            hits = [i for i, (name, _) in enumerate(named) if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise ValueError(f"optimizer.muon_params: {pattern!r} matches no trained parameter's name "
                                 f"(names look like {named[min(1, len(named) - 1)][0]!r})")
            for i in hits:
                why = _not_a_matrix(*named[i])
                if why is not None:
                    raise ValueError(f"optimizer.muon_params: {pattern!r} matches {named[i][0]}, {why}; narrow the "
                                     "pattern")
                chosen[i] = True
    return ([p for (_, p), c in zip(named, chosen) if c], [p for (_, p), c in zip(named, chosen) if not c])


# --- how the parameters are laid out ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RowShards:
    """A parameter split into row blocks over ``group`` (FSDP2's ``Shard(0)`` on one mesh dimension, the others
    replicated): rank r holds rows ``starts[r]:starts[r + 1]``."""

    group: Any
    rank: int
    starts: tuple[int, ...]

    def rows(self, rank: int) -> int:
        return self.starts[rank + 1] - self.starts[rank]


def _row_shards(name: str, param: Tensor) -> _RowShards | None:
    """The row blocks of a DTensor parameter, None for a plain tensor.

    Raises:
        ValueError: a DTensor split otherwise (tensor or expert parallel).
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    placements = param.placements
    shards = [i for i, p in enumerate(placements) if not isinstance(p, Replicate)]
    if not shards:  # replicated over its mesh (FSDP2 over a shard group of one): whole on every rank
        return None
    if len(shards) != 1 or type(placements[shards[0]]) is not Shard or placements[shards[0]].dim != 0:
        raise ValueError(f"optimizer: Muon steps whole matrices or FSDP2's row shards, but {name or 'a parameter'} is "
                         f"split as {tuple(placements)} (tensor or expert parallel); use another optimizer there")
    mesh_dim = shards[0]
    group = param.device_mesh.get_group(mesh_dim)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = param.shape[0]
    chunk = -(-rows // world)  # torch.chunk's, as Shard(0) cuts
    starts = tuple(min(rows, r * chunk) for r in range(world + 1))
    local = param.to_local().shape[0]
    if local != starts[rank + 1] - starts[rank]:
        raise ValueError(f"optimizer: {name}: {local} local rows where Shard(0) over {world} ranks gives "
                         f"{starts[rank + 1] - starts[rank]}")
    return _RowShards(group, rank, starts)


def _owners(sizes: Sequence[int], world: int) -> list[int]:
    """An owner rank for each matrix: the largest first, each to the rank with the fewest elements so far (the
    lowest such rank), so that every rank gets about 1/world of the work; the same on every rank."""
    load = [0] * world
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += sizes[i]
    return owners


def _buckets(items: list, numel: list[int], element_bytes: int) -> list[list[int]]:
    """Consecutive runs of ``items`` (indices) of at most :data:`BUCKET_BYTES` each (a larger matrix alone)."""
    buckets, current, size = [], [], 0
    for i in range(len(items)):
        if current and size + numel[i] * element_bytes > BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += numel[i] * element_bytes
    return buckets + ([current] if current else [])


def step_buffer_bytes(sizes: Sequence[int], *, world: int, sharded: bool, itemsize: int = 2,
                      update_itemsize: int = 4) -> int:
    """At most the transient bytes of one Muon step on a rank, for Muon matrices of ``sizes`` elements (whole) over
    ``world`` data-parallel ranks, ``sharded`` (FSDP2's row shards) or replicated (DDP), iterating in ``itemsize``
    bytes with updates of ``update_itemsize``: the largest matrix's (Nesterov) update and the iteration's working
    copies of it (its normalized self, Gram matrix, polynomial and next iterate), and the exchange buffers of the
    largest bucket: under DDP this rank's results and everyone's all-gathered; sharded, this rank's rows of the
    bucket out and back, and its owned matrices whole in and out."""
    if not sizes:
        return 0
    largest = max(sizes)
    working = largest * (update_itemsize + 4 * itemsize)
    if world == 1:
        return working
    bucket = max(largest, min(sum(sizes), BUCKET_BYTES // itemsize))
    share = -(-bucket // world)
    if sharded:
        return working + share * update_itemsize + itemsize * (2 * share + 2 * max(largest, share))
    return working + itemsize * (bucket + share)


@dataclass
class StepStats:
    """What this rank did in the last step: matrices (or stacks of expert matrices) orthogonalized here, and the
    bytes it sent to other ranks to do it."""

    orthogonalized: int = 0
    bytes_sent: int = 0
    owners: dict[int, int] = field(default_factory=dict)


# --- the optimizer ------------------------------------------------------------------------------------------------------


class Muon(Optimizer):
    """Muon on the hidden matrices and AdamW on the rest of ``params``, in one optimizer (two parameter groups).

    ``params`` are ``(name, parameter)`` pairs (the recipes pass the trainable ones so, see
    :func:`~toolkit.optim.optimizers.optimizer_parameters`): the names choose the groups. Plain parameters go by shape
    (matrices to Muon); groups built by this class (``algorithm`` in each, as ZeRO-1 hands them back) are kept.

    Args:
        params: named parameters, plain parameters, or this class's groups.
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: the Muon group's,
            with ``torch.optim.Muon``'s meanings and defaults.
        ns_dtype: the iteration's dtype: ``bfloat16`` as torch's Muon, ``float32`` or ``float64`` to compare
            layouts at tighter tolerances.
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW group's (torch.optim.AdamW's defaults).
        adamw_fused: torch's fused AdamW kernel for that group (None: torch's choice).
        muon_params: ``fnmatch`` patterns of the parameter names Muon steps (every other parameter goes to AdamW);
            None: every hidden matrix (see :func:`muon_by_default`).
        muon_adapters: without ``muon_params``, Muon steps LoRA's A and B too.

    Raises:
        ValueError: a hyperparameter out of range, or ``muon_params`` that select what Muon cannot step.
    """

    takes_parameter_names = True  # the recipes pass (name, parameter) pairs (toolkit.optim.optimizer_parameters)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Sequence[float] = NS_COEFFICIENTS,
        ns_steps: int = NS_STEPS,
        eps: float = NS_EPS,
        adjust_lr_fn: str | None = None,
        ns_dtype: str = "bfloat16",
        adamw_lr: float = 1e-3,
        adamw_betas: Sequence[float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        adamw_fused: bool | None = None,
        muon_params: Sequence[str] | None = None,
        muon_adapters: bool = False,
    ) -> None:
        checks = {  # key: (passes, the range)
            "lr": (lr > 0, "a number > 0"), "adamw_lr": (adamw_lr > 0, "a number > 0"),
            "weight_decay": (weight_decay >= 0, "a number >= 0"),
            "adamw_weight_decay": (adamw_weight_decay >= 0, "a number >= 0"),
            "momentum": (0 <= momentum < 1, "a number in [0, 1)"),
            "eps": (eps > 0, "a number > 0"), "adamw_eps": (adamw_eps > 0, "a number > 0"),
            "ns_steps": (isinstance(ns_steps, int) and 1 <= ns_steps < 100, "an integer from 1 to 99"),
            "ns_coefficients": (len(ns_coefficients) == 3, "three numbers a, b, c"),
            "adamw_betas": (len(adamw_betas) == 2 and all(0 <= b < 1 for b in adamw_betas), "two numbers in [0, 1)"),
        }
        for key, (ok, expected) in checks.items():
            if not ok:
                raise ValueError(f"optimizer.{key}: expects {expected}, got {locals()[key]!r}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"optimizer.adjust_lr_fn: {adjust_lr_fn!r} is not one of {', '.join(ADJUST_LR_FNS)}")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"optimizer.ns_dtype: {ns_dtype!r} is not one of {', '.join(NS_DTYPES)}")
        params = list(params)
        if params and isinstance(params[0], dict) and "algorithm" in params[0]:
            groups = params  # this class's own groups, handed back (ZeRO-1's share of them)
        else:
            if not params or isinstance(params[0], tuple):
                muon, adamw = split_parameters(params, muon_params=muon_params, adapters=muon_adapters)
            elif muon_params is not None:
                raise TypeError("Muon: muon_params needs (name, parameter) pairs")
            else:
                muon = [p for p in params if 2 <= p.ndim <= 3]
                adamw = [p for p in params if not 2 <= p.ndim <= 3]
            groups = [
                {"params": muon, "algorithm": "muon", "lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                 "nesterov": nesterov, "ns_coefficients": tuple(ns_coefficients), "ns_steps": ns_steps, "eps": eps,
                 "adjust_lr_fn": adjust_lr_fn, "ns_dtype": ns_dtype},
                {"params": adamw, "algorithm": "adamw", "lr": adamw_lr, "betas": tuple(adamw_betas),
                 "eps": adamw_eps, "weight_decay": adamw_weight_decay, "fused": adamw_fused},
            ]
        super().__init__(groups, {})
        self._replicas: Any = None  # the process group whose ranks share the orthogonalization of whole matrices
        self.stats = StepStats()

    def share_orthogonalization(self, group: Any = None) -> Muon:
        """Divide the orthogonalization of whole (replicated) matrices among the ranks of ``group`` (None: the
        default group), as under DDP, where every rank holds the same gradient and momentum. Returns self."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            self._replicas = group if group is not None else dist.group.WORLD
        return self

    # --- the step -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001 (Optimizer's signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.stats = StepStats()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _adamw_step(self, group: dict) -> None:
        from torch.optim.adam import adam
        from torch.optim.optimizer import _get_scalar_dtype

        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        fused = bool(group.get("fused"))
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=True), device=p.device) if fused
                                 else torch.tensor(0.0, dtype=_get_scalar_dtype()))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, fused=group.get("fused"),
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)

    def _muon_step(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        momentum, nesterov = group["momentum"], group["nesterov"]
        dtype = NS_DTYPES[group["ns_dtype"]]

        def update(p: Tensor) -> Tensor:
            # The momentum step of one parameter, and the (Nesterov) update to orthogonalize: made one bucket at a
            # time, so that no copy of every matrix's update ever exists at once.
            grad, state = _local(p.grad), self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = _local(state["momentum_buffer"])
            buf.lerp_(grad, 1 - momentum)
            return grad.lerp(buf, momentum) if nesterov else buf

        def ortho(x: Tensor) -> Tensor:
            self.stats.orthogonalized += 1
            return orthogonalize(x, coefficients=group["ns_coefficients"], steps=group["ns_steps"], eps=group["eps"],
                                 dtype=dtype)

        def apply(p: Tensor, orthogonal: Tensor) -> None:
            local = _local(p)
            local.mul_(1 - group["lr"] * group["weight_decay"])
            local.add_(orthogonal, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))

        layouts = [_row_shards("", p) for p in params]
        # Row shards: exchanged within each shard group (one per mesh), matrices of one dtype per exchange.
        by_group: dict[tuple, list[int]] = {}
        for i, layout in enumerate(layouts):
            if layout is not None:
                key = (tuple(dist.get_process_group_ranks(layout.group)), params[i].dtype)
                by_group.setdefault(key, []).append(i)
        for indices in by_group.values():
            for bucket in _buckets(indices, [params[i].numel() for i in indices], dtype.itemsize):
                chosen = [indices[j] for j in bucket]
                results = self._exchange_rows([params[i] for i in chosen], [update(params[i]) for i in chosen],
                                              [layouts[i] for i in chosen], dtype, ortho)
                for i, result in zip(chosen, results):
                    apply(params[i], result)
        whole = [i for i, layout in enumerate(layouts) if layout is None]
        if self._replicas is None:
            for i in whole:
                apply(params[i], ortho(update(params[i])))
            return
        for bucket in _buckets(whole, [params[i].numel() for i in whole], dtype.itemsize):
            chosen = [params[whole[j]] for j in bucket]
            for p, result in zip(chosen, self._share(chosen, update, dtype, ortho)):
                apply(p, result)

    def _share(self, params: list[Tensor], update, dtype: torch.dtype, ortho) -> list[Tensor]:  # noqa: ANN001
        """Whole matrices, replicated over :attr:`_replicas`: every rank steps every momentum buffer, each matrix's
        owner alone orthogonalizes its update, and the results are all-gathered."""
        group = self._replicas
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = [p.numel() for p in params]
        owners = _owners(sizes, world)
        load = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
        send = torch.zeros(max(load), dtype=dtype, device=params[0].device)
        offset = 0
        for p, o in zip(params, owners):
            u = update(p)  # (every rank's momentum steps; only the owner needs the update)
            if o == rank:
                send[offset: offset + p.numel()] = ortho(u).reshape(-1)
                offset += p.numel()
        gathered = torch.empty(world * max(load), dtype=dtype, device=send.device)
        # all_gather_into_tensor's new name (torch 2.13 deprecates the old one; older releases have only it).
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, send, group=group)
        self.stats.bytes_sent += send.numel() * send.element_size() * (world - 1)
        self.stats.owners = {r: self.stats.owners.get(r, 0) + owners.count(r) for r in range(world)}
        offsets = [r * max(load) for r in range(world)]
        results = []
        for p, o in zip(params, owners):
            results.append(gathered[offsets[o]: offsets[o] + p.numel()].view(p.shape))
            offsets[o] += p.numel()
        return results

    def _exchange_rows(
        self, params: list[Tensor], updates: list[Tensor], layouts: list[_RowShards], dtype: torch.dtype, ortho,  # noqa: ANN001
    ) -> list[Tensor]:
        """Row shards of matrices over one shard group: each owner gathers its matrices' rows (all-to-all), orthogonalizes
        them whole and sends every rank its rows back (all-to-all). Returns this rank's rows of each result."""
        group, rank = layouts[0].group, layouts[0].rank
        world = len(layouts[0].starts) - 1
        shapes = [p.shape for p in params]
        inner = [math.prod(s[1:]) for s in shapes]
        owners = _owners([p.numel() for p in params], world)
        self.stats.owners = {r: self.stats.owners.get(r, 0) + owners.count(r) for r in range(world)}
        device = updates[0].device
        # Out: this rank's rows of each matrix, to its owner (in owner order, then matrix order).
        order = sorted(range(len(params)), key=lambda i: (owners[i], i))
        send = torch.cat([updates[i].reshape(-1).to(dtype) for i in order]) if order else torch.empty(0, dtype=dtype)
        send_splits = [sum(layouts[i].rows(rank) * inner[i] for i in order if owners[i] == r) for r in range(world)]
        mine = [i for i in order if owners[i] == rank]
        recv_splits = [sum(layouts[i].rows(s) * inner[i] for i in mine) for s in range(world)]
        received = torch.empty(sum(recv_splits), dtype=dtype, device=device)
        dist.all_to_all_single(received, send, recv_splits, send_splits, group=group)
        self.stats.bytes_sent += (send.numel() - send_splits[rank]) * send.element_size()
        # Assemble, orthogonalize, cut back into rows (per source rank, in matrix order).
        pieces_from = list(torch.split(received, recv_splits))
        results = {}
        for s in range(world):
            offset = 0
            for i in mine:
                n = layouts[i].rows(s) * inner[i]
                results.setdefault(i, []).append(pieces_from[s][offset: offset + n].view(layouts[i].rows(s), *shapes[i][1:]))
                offset += n
        back = []
        for i in mine:
            whole = ortho(torch.cat(results[i]))
            results[i] = [whole[layouts[i].starts[s]: layouts[i].starts[s + 1]] for s in range(world)]
        for s in range(world):
            back.extend(results[i][s].reshape(-1) for i in mine)
        send_back = torch.cat(back) if back else torch.empty(0, dtype=dtype, device=device)
        returned = torch.empty(sum(send_splits), dtype=dtype, device=device)
        dist.all_to_all_single(returned, send_back, send_splits, recv_splits, group=group)
        self.stats.bytes_sent += (send_back.numel() - recv_splits[rank]) * send_back.element_size()
        out: list[Tensor | None] = [None] * len(params)
        offset = 0
        for i in order:
            n = layouts[i].rows(rank) * inner[i]
            out[i] = returned[offset: offset + n].view(layouts[i].rows(rank), *shapes[i][1:])
            offset += n
        return out


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (the same storage), a plain tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
