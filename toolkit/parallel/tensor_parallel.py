"""Tensor parallelism (Shoeybi et al., 2019, https://arxiv.org/abs/1909.08053) applied to a plain decoder from
outside, on PyTorch's DTensor: every decoder layer is split over the ``tp`` ranks of a TP group. The layers, the
token embedding, the final norm and the output projection are the model's answers to its contract
(:class:`~toolkit.modules.contract.DecoderModel`), not attributes read by name.

The plan, the same for every family in :mod:`toolkit.models` (they share these module names):

- attention: ``q_proj``, ``k_proj``, ``v_proj`` column-wise (each rank computes ``num_heads / tp`` query heads and
  ``num_kv_heads / tp`` key/value heads, so attention itself runs on local heads with no communication; the
  attention reads its head counts from the tensors), ``o_proj`` row-wise (one all-reduce);
- MLP: ``gate_proj``, ``up_proj`` column-wise, ``down_proj`` row-wise (one all-reduce);
- token embedding and output projection (tied or not) sharded over the vocabulary: each rank looks up the tokens
  of the rows it holds (the lookups summed in one all-reduce; the gradient of its rows only), and the fused
  projection-and-loss (:func:`toolkit.modules.loss.linear_cross_entropy_sum`) computes each rank's vocabulary
  shard of the logits chunk by chunk, with the softmax's max and sum and the label's logit reduced over the group:
  in training no rank ever holds whole logits. Where
  logits are asked for (generation, evaluation), they are gathered whole on every rank, so that every rank picks
  the same next token;
- everything else (norms, Qwen 3's per-head q/k norms) replicated.

LoRA and DoRA adapters are split with their base: for a column-wise base, ``lora_b`` (and DoRA's magnitude) is
split like the base's rows and ``lora_a`` replicated; for a row-wise base, ``lora_a`` is split like its columns and
``lora_b`` replicated, and DoRA's row norm, taken over the split columns, is reduced over the group (DTensor does
it). Biases (Qwen's q/k/v) follow their projection's rows.

A KV cache (generation) holds this rank's key/value heads only.

Sequence parallelism (``sequence_parallel=True``; Korthikanti et al., 2022, https://arxiv.org/abs/2205.05198):
between the blocks, the residual stream and the norms are split along the sequence too, so each rank holds and
normalizes ``1/tp`` of the positions instead of all of them. Each block all-gathers its input (the attention and
the MLP see the whole sequence, so masks and rotary positions are unchanged), and its row-wise projection
reduce-scatters its output back to this rank's positions instead of all-reducing it (the same bytes as the
all-reduce it replaces, split in two); the embedding reduce-scatters its lookup, and the final norm's output is
gathered for the vocabulary-parallel loss. The norms' weight gradients are then partial sums over the positions,
summed over the group. It applies to a forward whose length divides by ``tp`` (the recipes pad every batch to a
multiple of it) and that has no KV cache; any other (a one-token decoding step) runs as without it.

Grouped-query attention with fewer key/value heads than TP ranks is refused rather than replicating the key/value
heads: :func:`check_tensor_parallel` says which degrees fit.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from toolkit.errors import UserError
from toolkit.modules.attention import GroupedQueryAttention
from toolkit.modules.moe import MoEFeedForward
from toolkit.modules.peft.nf4 import is_nf4

_COLUMN_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PROJECTIONS = ("o_proj", "down_proj")


# A placement, or what gives the current forward's (the residual stream's, under sequence parallelism).
PlacementOf = Placement | Callable[[], Placement]


@dataclass(frozen=True)
class _Split:
    """How one module is laid over the TP group: its parameters' placements (by name; any other parameter is
    replicated), and how its input arrives and its output leaves (as plain tensors holding this rank's part)."""

    params: dict[str, Placement] = field(default_factory=dict)
    input: Placement = Replicate()
    output: PlacementOf = Replicate()


@dataclass
class _SequenceSplit:
    """Whether the forward in progress splits the residual stream along the sequence: decided by the decoder's
    forward pre-hook for each forward, read by the hooks between the blocks."""

    tp: int
    active: bool = False

    def residual(self) -> Placement:
        """Where the residual stream lives between blocks: this rank's positions, or all of them."""
        return Shard(1) if self.active else Replicate()

    def norm_grad(self) -> Placement:
        """A replicated norm's weight gradient: a partial sum when it saw only this rank's positions."""
        return Partial() if self.active else Replicate()


# A column-wise projection's rows (its output features) are split; a LoRA adapter's B rows and DoRA's magnitude
# follow them, A is replicated. A row-wise projection's columns (its input features) are split, and A's with them.
_COLUMN = _Split(
    params={"weight": Shard(0), "bias": Shard(0), "lora_b.weight": Shard(0), "magnitude": Shard(0)},
    input=Replicate(), output=Shard(-1),
)
_ROW = _Split(params={"weight": Shard(1), "lora_a.weight": Shard(1)}, input=Shard(-1), output=Replicate())
_VOCAB_EMBEDDING = _Split(params={"weight": Shard(0)}, input=Replicate(), output=Replicate())
# The output projection's logits, where they are asked for (generation, scoring), are gathered whole; the fused
# loss reads its weights directly and never calls it, so training keeps them split.
_VOCAB_OUTPUT = _Split(params={"weight": Shard(0), "lora_b.weight": Shard(0)}, input=Replicate(), output=Replicate())


def check_tensor_parallel(model: nn.Module, *, tp: int) -> None:
    """Refuse, in one line naming the numbers, a model that ``tp`` ranks cannot split: attention heads, key/value
    heads, MLP width or vocabulary that ``tp`` does not divide, NF4 (QLoRA) base weights, or an output layer the
    vocabulary-parallel loss cannot take. Works on the meta device (only shapes are read)."""
    if tp == 1:
        return
    what = f"tensor_parallel: {tp} ranks cannot split"
    layers = list(model.decoder_layers().values())
    if not all(isinstance(getattr(layer, "self_attn", None), GroupedQueryAttention) for layer in layers):
        raise UserError(
            f"{what} this model: its layers are transformers' (the transformers backend), whose projections the "
            "tensor-parallel plan does not know; use tensor_parallel=1 with data_parallel (ddp, zero3...)"
        )
    if any(isinstance(layer.mlp, MoEFeedForward) for layer in layers):
        raise UserError(
            f"{what} mixture-of-experts layers (their experts are not split by tensor parallelism); use "
            "tensor_parallel=1 with data_parallel (ddp, zero3...)"
        )
    for layer in layers:
        attn = layer.self_attn
        if attn.num_heads % tp:
            heads = attn.num_heads
            raise UserError(f"{what} the model's {heads} attention heads; choose a divisor of {heads}")
        if attn.num_kv_heads % tp:
            raise UserError(
                f"{what} the model's {attn.num_kv_heads} key/value heads (they are not replicated); choose a divisor "
                f"of {attn.num_kv_heads}"
            )
        width = layer.mlp.gate_proj.weight.shape[0]
        if width % tp:
            raise UserError(f"{what} the model's MLP width of {width}; choose a divisor of {width}")
    vocab = model.token_embedding().weight.shape[0]
    if vocab % tp:
        raise UserError(f"{what} the model's vocabulary of {vocab} tokens; choose a divisor of {vocab}")
    if any(is_nf4(p) for p in model.parameters()):
        raise UserError(
            f"tensor_parallel: NF4 (QLoRA) base weights cannot be split over {tp} ranks; use tensor_parallel=1 "
            "(QLoRA shards under data_parallel=zero3), or LoRA on a bf16 base (quantize_base=false)"
        )
    if model.fused_loss_weight() is None:
        raise UserError(
            f"tensor_parallel: the output layer ({type(model.output_projection()).__name__}) cannot take the "
            "vocabulary-parallel loss, which needs a plain (or LoRA) bias-free projection or tied embeddings; do not "
            "adapt the output with DoRA, or use tensor_parallel=1"
        )


def apply_tp(model: nn.Module, *, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over ``tp_mesh`` (the mesh's ``tp`` dimension) in place, with the plan of the module
    docstring (``sequence_parallel``: the residual stream and norms split along the sequence too); call it on the
    meta device, before data parallelism (FSDP2 then shards each TP shard further).

    Every parameter becomes a DTensor on ``tp_mesh``, so the gradient norm and the optimizer see one kind of
    tensor. Between modules activations stay plain tensors (this rank's part), so the model's own code runs
    unchanged.

    Raises:
        UserError: a model ``tp_mesh.size()`` ranks cannot split (:func:`check_tensor_parallel`).
    """
    check_tensor_parallel(model, tp=tp_mesh.size())
    split = _SequenceSplit(tp=tp_mesh.size())
    residual, norm_grad = (split.residual, split.norm_grad) if sequence_parallel else (Replicate(), Replicate())
    if sequence_parallel:
        model.register_forward_pre_hook(partial(_decide_sequence_split, split), with_kwargs=True)
        model.final_norm().register_forward_hook(partial(_gather_sequence, tp_mesh, split))
    for module, plan in split_modules(model):
        if plan is _VOCAB_EMBEDDING:
            _split_embedding(module, tp_mesh, output=residual)
        else:  # a row-wise projection's output is the residual stream's part
            _distribute(module, tp_mesh, replace(plan, output=residual) if plan is _ROW else plan)
    for layer in model.decoder_layers().values():
        for parent in (layer.self_attn, layer.mlp):
            # One DTensor input for all of a block's column-wise projections: in backward their partial input
            # gradients are summed first and all-reduced once (not once per projection: 2 collectives a layer, not 5).
            parent.register_forward_pre_hook(partial(_replicated_input, tp_mesh, split))
        for name in ("q_norm", "k_norm"):
            # Qwen 3's per-head norms see only this rank's heads: their weights' gradients are partial sums.
            if getattr(layer.self_attn, name, None) is not None:
                _replicate(getattr(layer.self_attn, name), tp_mesh, grad=Partial())
    for module in model.modules():  # the norms, and anything else that holds parameters of its own
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            _replicate(module, tp_mesh, grad=norm_grad)
    return model


def split_modules(model: nn.Module) -> Iterator[tuple[nn.Module, _Split]]:
    """Every module :func:`apply_tp` splits, with its plan: the token embedding, the output projection (untied),
    and each layer's column- and row-wise projections. The memory plan (:mod:`toolkit.parallel.tp_shapes`) counts
    the shards of the same walk."""
    yield model.token_embedding(), _VOCAB_EMBEDDING
    output = model.output_projection()
    if output is not None:
        yield output, _VOCAB_OUTPUT
    for layer in model.decoder_layers().values():
        for parent in (layer.self_attn, layer.mlp):
            for name, child in parent.named_children():
                if name in _COLUMN_PROJECTIONS:
                    yield child, _COLUMN
                elif name in _ROW_PROJECTIONS:
                    yield child, _ROW


def _decide_sequence_split(split: _SequenceSplit, model: nn.Module, args: tuple, kwargs: dict) -> None:
    # Split when the length divides over the ranks and nothing is cached (a decoding step is one position).
    tokens = args[0] if args else kwargs["tokens"]
    split.active = tokens.shape[1] % split.tp == 0 and all(
        layer.self_attn.kv_cache is None for layer in model.decoder_layers().values()
    )


def _gather_sequence(
    mesh: DeviceMesh, split: _SequenceSplit, module: nn.Module, inputs: tuple, output: torch.Tensor
) -> torch.Tensor:
    # The final norm's positions, gathered: the vocabulary-parallel loss (and the logits) take the whole sequence on
    # every rank. Its gradient comes back whole on every rank (the loss sums its shares over the group), of which
    # each keeps its positions.
    if not split.active:
        return output
    local = DTensor.from_local(output, mesh, [Shard(1)], run_check=False)
    return local.redistribute(placements=[Replicate()]).to_local()


def _distribute(module: nn.Module, mesh: DeviceMesh, split: _Split) -> None:
    def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
        if submodule is not module:  # parameters are placed by their name relative to the module
            return
        for param_name, param in list(module.named_parameters()):
            if isinstance(param, DTensor):
                continue
            placement = split.params.get(param_name, Replicate())
            sharded = nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
            if placement == Replicate() and sharded.requires_grad:
                sharded.register_hook(_replicated_grad)
            owner, _, attr = param_name.rpartition(".")
            module.get_submodule(owner).register_parameter(attr, sharded)

    distribute_module(module, mesh, partition, partial(_wrap_input, split.input), partial(_unwrap_output, split.output))


def _split_embedding(module: nn.Module, mesh: DeviceMesh, *, output: PlacementOf) -> None:
    """Split the token embedding's rows (the vocabulary) over ``mesh``, each rank looking up the tokens it holds
    in its own rows, zeros for the others, and the lookups summed over the group.

    The lookup runs on plain tensors rather than DTensor's embedding, whose backward makes the gradient of the whole
    table on every rank (measured: a replicated ``[vocab, d]`` gradient, 2 GB for a 70B model's in bf16); here it
    is this rank's rows only. An embedding that scales its output (Gemma's) scales its zeros too."""
    weight = module.weight
    sharded = nn.Parameter(distribute_tensor(weight, mesh, [_VOCAB_EMBEDDING.params["weight"]]),
                           requires_grad=weight.requires_grad)
    module.register_parameter("weight", sharded)
    module.register_forward_pre_hook(partial(_look_up_own_rows, mesh))
    module.register_forward_hook(partial(_sum_lookups, mesh, output))


def _look_up_own_rows(mesh: DeviceMesh, module: nn.Module, inputs: tuple) -> tuple:
    # The rows this rank holds: rank r of the group the r-th chunk, as DTensor splits (torch.chunk sizes).
    weight = module._parameters["weight"]
    local = weight.to_local(grad_placements=[Shard(0)])
    start = -(-weight.shape[0] // mesh.size()) * mesh.get_local_rank()
    module.__dict__["weight"] = local  # found before the registered parameter, for this forward (see _replicate)
    tokens = inputs[0] - start
    outside = (tokens < 0) | (tokens >= local.shape[0])
    module.__dict__["_outside_rows"] = outside
    return (tokens.masked_fill(outside, 0), *inputs[1:])


def _sum_lookups(mesh: DeviceMesh, placement: PlacementOf, module: nn.Module, inputs: tuple, output: torch.Tensor):
    module.__dict__.pop("weight", None)
    outside = module.__dict__.pop("_outside_rows")
    output = output.masked_fill(outside.unsqueeze(-1), 0.0)  # (in backward: no gradient to row 0 for them)
    placement = placement() if callable(placement) else placement
    summed = DTensor.from_local(output, mesh, [Partial()], run_check=False)
    return summed.redistribute(placements=[placement]).to_local()


def _replicate(module: nn.Module, mesh: DeviceMesh, *, grad: PlacementOf) -> None:
    """Replicate ``module``'s own parameters over ``mesh``, and run it on plain tensors: its input is whole on every
    rank (or, ``grad=Partial()``, this rank's heads), so it computes without communication, and DTensor's dispatch
    would only slow each of its small ops down. Its gradients are whole (or, with ``Partial``, this rank's share)."""
    for name, param in list(module.named_parameters(recurse=False)):
        replicated = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]), requires_grad=param.requires_grad)
        if replicated.requires_grad:
            replicated.register_hook(_replicated_grad)
        module.register_parameter(name, replicated)
    module.register_forward_pre_hook(partial(_shadow_with_local_parameters, grad))
    module.register_forward_hook(_unshadow_parameters)


def _shadow_with_local_parameters(grad: PlacementOf, module: nn.Module, inputs: tuple) -> None:
    grad = grad() if callable(grad) else grad
    # An instance attribute is found before nn.Module.__getattr__ looks in _parameters: for the forward,
    # ``module.weight`` is the local tensor (a differentiable view: its gradient reaches the DTensor parameter).
    # The parameters themselves stay registered (FSDP2 swaps them in and out of _parameters around the forward).
    for name, param in module._parameters.items():
        if param is not None:
            module.__dict__[name] = param.to_local(grad_placements=[grad])


def _unshadow_parameters(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
    for name in module._parameters:
        module.__dict__.pop(name, None)


def _replicated_grad(grad: DTensor) -> DTensor:
    # A replicated parameter used on sharded activations gets a partial gradient (a per-head norm sees only this
    # rank's heads; an adapter's replicated A sees a split B's): sum it, so that every rank holds the whole one.
    # Under FSDP2 this tensor is not the one in use, and FSDP2 does the same itself.
    return grad.redistribute(placements=[Replicate()]) if grad.placements != (Replicate(),) else grad


def _replicated_input(mesh: DeviceMesh, split: _SequenceSplit, module: nn.Module, inputs: tuple) -> tuple:
    first, *rest = inputs
    if split.active:  # this rank's positions: all-gathered (and in backward, the gradient reduce-scattered)
        return (DTensor.from_local(first, mesh, [Shard(1)], run_check=False).redistribute(placements=[Replicate()]),
                *rest)
    return (DTensor.from_local(first, mesh, [Replicate()], run_check=False), *rest)


def _wrap_input(placement: Placement, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    first, *rest = inputs
    if not isinstance(first, DTensor):
        first = DTensor.from_local(first, mesh, [placement], run_check=False)
    return (first, *rest)


def _unwrap_output(placement: PlacementOf, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    placement = placement() if callable(placement) else placement
    if output.placements != (placement,):
        output = output.redistribute(placements=[placement])
    return output.to_local()

