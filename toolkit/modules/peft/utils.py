"""Model-wide adapter helpers: initialize, select and freeze parameters, filter state dicts, merge, disable."""

from collections.abc import Collection, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from toolkit.modules.moe import PROJECTIONS, GroupedExperts
from toolkit.modules.peft.experts import LoRAGroupedExperts, TrainedRouter
from toolkit.modules.peft.lora import DoRALinear, LoRALinear
from toolkit.modules.peft.nf4 import NF4Linear, dequantize
from toolkit.modules.peft.nf4_experts import nf4_stacks

_ADAPTER_SUFFIXES = (".lora_a.weight", ".lora_b.weight", ".magnitude")


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear | LoRAGroupedExperts]:
    """Every LoRA/DoRA layer and every set of adapted experts of ``model`` by its module name
    (``layers.0.self_attn.q_proj``, ``layers.0.mlp.experts``)."""
    return {
        name: module for name, module in model.named_modules() if isinstance(module, (LoRALinear, LoRAGroupedExperts))
    }


def training_method(model: nn.Module) -> str:
    """How ``model`` trains, as a step checkpoint records it: ``full`` (every weight), ``lora`` or ``dora`` (adapters
    over frozen weights), ``qlora`` or ``qdora`` (over NF4-quantized ones). A checkpoint of one method holds other
    tensors than another's, so it resumes only under its own."""
    adapters = adapter_modules(model).values()
    if not adapters:
        return "full"
    kind = "dora" if any(isinstance(module, DoRALinear) for module in adapters) else "lora"
    quantized = any(getattr(module, "quantize_base", False) for module in adapters) or bool(nf4_stacks(model))
    return f"q{kind}" if quantized else kind


def trained_routers(model: nn.Module) -> dict[str, TrainedRouter]:
    """Every router of ``model`` trained whole next to the adapters (``train_router``), by module name
    (``layers.0.mlp.gate``)."""
    return {name: module for name, module in model.named_modules() if isinstance(module, TrainedRouter)}


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key names an adapter parameter (``...q_proj.lora_a.weight``, ``...magnitude``).

    Pass it as ``HFCheckpointer.load(model, ignore_missing=is_adapter_key)``: a base checkpoint has no adapters.
    """
    return key.endswith(_ADAPTER_SUFFIXES)


@torch.no_grad()
def init_adapters(model: nn.Module) -> None:
    """Initialize every adapter of ``model``: LoRA ``A`` Kaiming-uniform and ``B`` zero, DoRA magnitudes set to the
    base rows' norms.

    Call once the base weights are in place (loaded from a checkpoint or initialized), before training or before
    loading a saved adapter state; the model then computes exactly what its base computes.
    """
    for module in adapter_modules(model).values():
        module.reset_lora_parameters()
        if isinstance(module, DoRALinear):
            module.initialize_dora_magnitude()


def get_adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """What a LoRA model trains, by full name: every adapter's parameters
    (``layers.0.self_attn.q_proj.lora_a.weight``) and the weights of the routers trained whole
    (``layers.0.mlp.gate.weight``, :func:`trained_routers`)."""
    params = {}
    for prefix, module in adapter_modules(model).items():
        for name in module.adapter_params():
            params[f"{prefix}.{name}" if prefix else name] = module.get_parameter(name)
    for prefix, router in trained_routers(model).items():
        params[f"{prefix}.weight"] = router.weight
    return params


def set_trainable_params(model: nn.Module, trainable: Collection[str]) -> None:
    """Make exactly the parameters named in ``trainable`` require gradients, and freeze all others.

    ``set_trainable_params(model, get_adapter_params(model))`` trains only the adapters, so data parallelism
    all-reduces only their gradients and the optimizer holds state only for them.

    Raises:
        ValueError: a name in ``trainable`` is not a parameter of ``model``.
    """
    names = {name for name, _ in model.named_parameters()}
    unknown = sorted(set(trainable) - names)
    if unknown:
        raise ValueError(f"not parameters of the model: {unknown[:3]}")
    for name, param in model.named_parameters():
        param.requires_grad_(name in trainable)


def get_adapter_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter entries of a model state dict (what a step checkpoint must keep: the base never changes)."""
    return {key: value for key, value in state_dict.items() if is_adapter_key(key)}


def _dense_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    # The plain-linear weight of every adapted or quantized layer (the stacked weights of adapted or NF4 experts),
    # by state-dict key.
    weights = {}
    for name, module in adapter_modules(model).items():
        if isinstance(module, LoRAGroupedExperts):
            weights.update({f"{name}.{param}": merged for param, merged in module.merged_weights().items()})
        else:
            weights[f"{name}.weight"] = module.merged_weight()
    for name, module in model.named_modules():
        if isinstance(module, NF4Linear):
            weights[f"{name}.weight"] = dequantize(module.weight)
    for name, stack in nf4_stacks(model).items():
        if name not in weights:  # not adapted (an adapted stack's merged weight is already there)
            weights[name] = stack.dequantize()
    return weights


@torch.no_grad()
def get_merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the plain model that computes what ``model`` computes: adapters merged into their base
    weights (LoRA: ``W + s B A``; DoRA: ``m (W + s B A) / ||W + s B A||``), NF4 weights dequantized, adapter keys
    dropped. Keys are those of the model built without adapters. ``model`` is left unchanged.
    """
    dense = _dense_weights(model)
    # An NF4 stack's parts (layers.0.mlp.experts.gate_proj.codes...) are one dense tensor (...experts.gate_proj).
    stack_of = {
        f"{name}.{part}": name for name, stack in nf4_stacks(model).items() for part, _ in stack.named_parameters()
    }
    merged = {}
    for key, value in model.state_dict().items():
        if is_adapter_key(key):
            continue
        key = stack_of.get(key, key)
        if key not in merged:
            merged[key] = dense.get(key, value)
    return merged


@torch.no_grad()
def merge_lora_weights(model: nn.Module) -> nn.Module:
    """Replace, in place, every LoRA/DoRA layer by a plain ``nn.Linear`` holding its merged weight, every NF4
    layer by a dequantized one, and adapted or NF4 experts by plain ones; return the model (a new module if ``model``
    itself was such a layer).

    The result has no adapter and no torchao tensor: save it with ``HFCheckpointer.save`` or export it anywhere.
    Merged weights take the adapter's dtype (the NF4 layers' their nominal dtype).
    """
    replaced: dict[str, nn.Module] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRAGroupedExperts) or (isinstance(module, GroupedExperts) and nf4_stacks(module)):
            gate_proj = module.gate_proj
            plain = GroupedExperts(
                num_experts=module.num_experts, dim=gate_proj.shape[2], hidden_dim=gate_proj.shape[1],
                activation=module.activation,
            ).to(device="meta")
            weights = module.merged_weights() if isinstance(module, LoRAGroupedExperts) else {
                param: module.base_weight(param) for param in PROJECTIONS
            }
            for param, merged in weights.items():
                setattr(plain, param, nn.Parameter(merged.detach().clone()))
            replaced[name] = plain
        elif isinstance(module, (LoRALinear, NF4Linear)):
            weight = module.merged_weight() if isinstance(module, LoRALinear) else dequantize(module.weight)
            linear = nn.Linear(module.in_dim, module.out_dim, bias=module.bias is not None, device="meta")
            linear.weight = nn.Parameter(weight.detach().clone())
            if module.bias is not None:
                linear.bias = nn.Parameter(module.bias.detach().clone())
            replaced[name] = linear
    for name, linear in replaced.items():
        if not name:
            return linear
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, linear)
    return model


@contextmanager
def disable_adapters(model: nn.Module) -> Iterator[None]:
    """Within the block, every adapter layer computes its base only (e.g. a DPO reference model for free)."""
    modules = list(adapter_modules(model).values())
    previous = [module.disabled for module in modules]
    for module in modules:
        module.disabled = True
    try:
        yield
    finally:
        for module, was in zip(modules, previous):
            module.disabled = was
