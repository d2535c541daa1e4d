"""Optimizers in the recipes: built from the config's ``optimizer`` node over what trains (:func:`build_optimizer`),
torch's Adam and AdamW fused by default (:func:`fused_by_default`), and the step inside backward.

The optimizer step inside backward: each parameter is updated as soon as its gradient is ready, and that gradient
is freed at once, so the gradients of the whole model never exist together (their memory, up to 4 bytes per
trained parameter in fp32, shrinks to one parameter's).

The price is what a step needs every gradient for: no gradient accumulation over micro-batches (the first
micro-batch's gradient would already have been applied), no clipping of the global gradient norm, no fp16 loss
scaling (which skips the whole step when any gradient overflowed). :func:`check_optimizer_in_backward` refuses
those, and the data-parallel strategies where the gradient a hook sees is not yet the averaged one:

========  ==========================================================================================================
one rank  supported: ``Tensor.register_post_accumulate_grad_hook`` fires once per backward with the whole gradient
zero2/3   supported: FSDP2 runs the sharded parameters' post-accumulate-grad hooks itself, right after it assigns the
hsdp      reduce-scattered (for HSDP: also all-reduced) gradient (``foreach_reduce`` in
          ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``), so each rank steps its averaged shard
ddp       refused: the hook fires before DDP's bucketed all-reduce, i.e. on this rank's unaveraged gradient; and
          DDP's buckets hold every gradient until the step ends anyway, so there would be no memory to save
zero1     refused: ZeroRedundancyOptimizer updates whole parameters on their owner rank after backward and then
          broadcasts them; there is no per-parameter step to run early
========  ==========================================================================================================
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

import torch
from omegaconf import DictConfig, open_dict
from torch import nn
from torch.optim import Optimizer

from toolkit.config import instantiate
from toolkit.config._instantiate import locate
from toolkit.errors import UserError
from toolkit.parallel import SHARDED_STRATEGIES, ParallelDims, shard_optimizer_state, unwrap

# torch's optimizers with a fused implementation on CUDA and CPU (and every dtype the recipes train in).
_FUSABLE = {f"torch.optim.{name}" for name in ("Adam", "AdamW", "adam.Adam", "adamw.AdamW")}


def fused_by_default(optimizer_cfg: DictConfig, *, grad_scaler: torch.amp.GradScaler | None = None) -> DictConfig:
    """``optimizer_cfg`` with ``fused: true`` added when it builds torch's Adam or AdamW and sets neither ``fused``
    nor ``foreach``; otherwise unchanged (other optimizers, torchao's 8-bit AdamW among them, have no such switch).

    Fused, the update of all parameters is one kernel (per device and dtype), where torch's default is a
    multi-tensor loop on CUDA and one loop per parameter on the CPU; the arithmetic is the same. It works under
    every strategy: plain tensors, DDP, ZeroRedundancyOptimizer (which passes it to the optimizer it wraps) and
    FSDP2's DTensor shards, also with the step inside backward. ``fused: false`` (or ``foreach``) in the config
    keeps torch's choice. The exception is fp16 under FSDP2 (``grad_scaler`` a ``ShardedGradScaler``): the fused
    kernel takes that scaler's overflow flag, which has another shape than the plain scaler's, and fails on it;
    there torch's choice is kept.

    Raises:
        UserError: ``fused: true`` set in the config with a ``ShardedGradScaler``.
    """
    if optimizer_cfg.get("_component_") not in _FUSABLE:
        return optimizer_cfg
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(grad_scaler, ShardedGradScaler):
        if optimizer_cfg.get("fused"):
            raise UserError(
                "optimizer.fused: torch's fused Adam cannot step with FSDP2's fp16 loss scaler (dtype fp16-mixed "
                "under zero2, zero3 or hsdp); set optimizer.fused=false, or train in bf16"
            )
        return optimizer_cfg
    if "fused" in optimizer_cfg or "foreach" in optimizer_cfg:
        return optimizer_cfg
    fused = optimizer_cfg.copy()
    with open_dict(fused):  # (the recipes' configs may be read-only in structure)
        fused.fused = True
    return fused


# Module names the wrappers insert into parameter names (activation checkpointing, torch.compile), left out of the
# names an optimizer that chooses by name sees, so that its patterns read like the model's own names.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def takes_parameter_names(optimizer_cfg: DictConfig) -> bool:
    """Whether the config's optimizer chooses its parameter groups by name (its class sets
    ``takes_parameter_names``, as :class:`~toolkit.optim.Muon` does)."""
    try:
        return bool(getattr(locate(optimizer_cfg.get("_component_")), "takes_parameter_names", False))
    except Exception:  # noqa: BLE001 (a component that does not import is reported where it is built)
        return False


def optimizer_parameters(model: nn.Module, optimizer_cfg: DictConfig) -> list:
    """The trainable parameters of ``model`` as the config's optimizer takes them: ``(name, parameter)`` pairs for
    one that chooses its groups by name (:func:`takes_parameter_names`), the parameters otherwise. Names are the
    plain model's (``layers.0.attn.q_proj.weight``) under DDP, activation checkpointing and compile alike."""
    named = []
    for name, param in unwrap(model).named_parameters():
        if param.requires_grad:
            for wrapper in _WRAPPER_NAMES:
                name = name.replace(wrapper, "")
            named.append((name, param))
    return named if takes_parameter_names(optimizer_cfg) else [param for _, param in named]


class OptimizerInBackward(Optimizer):
    """Runs one optimizer per parameter from a hook during backward, and is used like the optimizer it replaces.

    ``make_optimizer([param])`` builds each parameter's optimizer (e.g. ``partial(instantiate, cfg.optimizer)``).
    This object has one param group over all parameters with that optimizer's hyperparameters: an LR scheduler
    sets the learning rate there, and each hook copies the group's hyperparameters into its parameter's optimizer
    just before stepping it. :meth:`step` has nothing left to do (the scheduler still expects it to be called).

    Save :attr:`optimizers`, not this object: ``get_optimizer_state_dict(model, optimizer.optimizers)`` from
    ``torch.distributed.checkpoint.state_dict`` keys their state by parameter name, exactly as for one optimizer
    over all parameters, so a step checkpoint does not depend on the mode that wrote it.

    Args:
        params: the parameters to train (FSDP2's sharded DTensors under zero2/zero3/hsdp).
        make_optimizer: builds the optimizer of a list holding one parameter.
    """

    def __init__(self, params: Iterable[nn.Parameter], make_optimizer: Callable[[list[nn.Parameter]], Optimizer]):
        params = list(params)
        if not params:
            raise ValueError("OptimizerInBackward: no parameters to optimize")
        self.optimizers: dict[nn.Parameter, Optimizer] = {param: make_optimizer([param]) for param in params}
        first_group = next(iter(self.optimizers.values())).param_groups[0]
        super().__init__(params, {key: value for key, value in first_group.items() if key != "params"})
        for param in params:
            param.register_post_accumulate_grad_hook(self._step_parameter)

    @torch.no_grad()
    def _step_parameter(self, param: nn.Parameter) -> None:
        optimizer = self.optimizers[param]
        hyperparameters = {key: value for key, value in self.param_groups[0].items() if key != "params"}
        optimizer.param_groups[0].update(hyperparameters)  # the learning rate the scheduler set for this step
        optimizer.step()
        param.grad = None

    def step(self, closure: None = None) -> None:
        """Nothing to do: every parameter was updated during backward, as soon as its gradient was ready."""

    def state_dict(self) -> dict:
        """Not this object's to give: the state lives in :attr:`optimizers` (see the class docstring)."""
        raise TypeError(
            "OptimizerInBackward keeps its state in .optimizers, one per parameter; save them with "
            "torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(model, optimizer.optimizers)"
        )


def check_optimizer_in_backward(
    *,
    dims: ParallelDims,
    micro_batch_size: int,
    accumulation_steps: int,
    max_grad_norm: float | None,
    grad_scaling: bool,
) -> None:
    """Refuse, with one line saying why and what to change, what the step inside backward cannot do correctly
    (see the module docstring).

    Args:
        dims: the data-parallel layout.
        micro_batch_size: sequences per device per forward/backward.
        accumulation_steps: micro-batches per optimizer step.
        max_grad_norm: the configured ``clip_grad_norm``.
        grad_scaling: whether fp16 loss scaling is on.

    Raises:
        UserError: gradient accumulation, gradient clipping, fp16 loss scaling, or DDP/ZeRO-1 on several processes.
    """
    what = "optimizer_in_backward: each parameter steps as soon as its gradient is ready"
    if accumulation_steps > 1:
        raise UserError(
            f"{what}, so gradients cannot accumulate over the {accumulation_steps} micro-batches of a step; set "
            f"micro_batch_size={micro_batch_size * accumulation_steps} (batch_size / processes) or a smaller "
            "batch_size, or optimizer_in_backward=false"
        )
    if max_grad_norm is not None:
        raise UserError(
            f"{what}, so no step ever holds every gradient to clip their global norm; set clip_grad_norm=null or "
            "optimizer_in_backward=false"
        )
    if grad_scaling:
        raise UserError(
            f"{what}, but fp16 loss scaling must skip the whole step when any gradient overflows, which is only "
            "known after backward; use dtype=bf16-mixed (or bf16), or optimizer_in_backward=false"
        )
    if dims.dp_size > 1 and not dims.uses_fsdp:
        why = (
            "the hook would fire before DDP averages the gradient across processes, and DDP's buckets keep every "
            "gradient anyway"
            if dims.strategy == "ddp"
            else "ZeroRedundancyOptimizer updates whole parameters on their owner process after backward"
        )
        raise UserError(
            f"{what}, which data_parallel={dims.strategy} cannot do on {dims.dp_size} processes: {why}; use "
            f"data_parallel={', '.join(SHARDED_STRATEGIES[:-1])} or {SHARDED_STRATEGIES[-1]}, or "
            "optimizer_in_backward=false"
        )


def build_optimizer(
    optimizer_cfg: DictConfig,
    *,
    model: nn.Module,
    dims: ParallelDims,
    grad_scaler: torch.amp.GradScaler | None = None,
    in_backward: bool = False,
) -> Optimizer:
    """The optimizer the config's ``optimizer`` node names, over the parameters of ``model`` that train, built after
    the model is parallelized (FSDP2's parameters are DTensor shards).

    torch's Adam(W) is fused where it can be (:func:`fused_by_default`, given the run's ``grad_scaler``); under
    ZeRO-1 the state is sharded over the data-parallel ranks (:func:`~toolkit.parallel.shard_optimizer_state`).
    With ``in_backward`` each parameter gets its own optimizer, stepped in backward as soon as its gradient is ready
    (:class:`OptimizerInBackward`; :func:`check_optimizer_in_backward` says what that refuses).

    Raises:
        UserError: as :func:`fused_by_default`, or what the optimizer's constructor refuses.
    """
    optimizer_cfg = fused_by_default(optimizer_cfg, grad_scaler=grad_scaler)
    if in_backward:
        trainable = [p for p in model.parameters() if p.requires_grad]
        return OptimizerInBackward(trainable, partial(instantiate, optimizer_cfg))
    return shard_optimizer_state(instantiate(optimizer_cfg, optimizer_parameters(model, optimizer_cfg)), dims=dims)
