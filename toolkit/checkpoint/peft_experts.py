"""Adapters on stacked experts (:class:`~toolkit.modules.peft.LoRAGroupedExperts`) in the PEFT format.

transformers 5 holds the experts of a mixture-of-experts block fused, for Qwen3-MoE and Mixtral alike:
``model.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and
``...experts.down_proj`` ``[E, H, I]``. PEFT adapts such parameters with ``target_parameters`` (peft 0.17 and
later; checked with 0.21): one adapter per parameter holding every expert's factors side by side,
``lora_A.weight`` ``[E * r, in]`` (expert ``e``'s ``A`` in rows ``e * r`` to ``(e + 1) * r``) and
``lora_B.weight`` ``[out, r * E]`` (expert ``e``'s ``B`` in columns ``e``, ``e + E``, ``e + 2E``...). Two adapted
parameters of one module nest, the first the module registers inside: ``gate_up_proj``'s adapter is
``...experts.base_layer.lora_A.weight``, ``down_proj``'s ``...experts.lora_A.weight``.

Ours has separate gate and up adapters of rank ``r``; on the fused ``gate_up_proj`` they are one adapter of rank
``2r``: ``A = [A_gate; A_up]`` and ``B = [[B_gate, 0], [0, B_up]]``, so that ``B A = [[B_gate A_gate], [B_up
A_up]]``, with ``lora_alpha`` doubled to keep the scale ``alpha / r`` (``rank_pattern`` and ``alpha_pattern``).
PEFT's parameter adapters take no dropout: adapters trained with ``lora_dropout`` > 0 have no PEFT form (the LoRA
recipe writes the merged model instead, and says why).

Routers trained whole (``train_router``) are PEFT's ``modules_to_save``: transformers 5 names every family's router
``mlp.gate`` (Mixtral's checkpoints ``block_sparse_moe.gate``, renamed on load), and PEFT saves such a module's
weights under the module's own name, ``base_model.model.model.layers.0.mlp.gate.weight``, and loads them onto a
trained copy of the module.
"""

import re

import torch
from torch.distributed.tensor import DTensor

from toolkit.modules._dtensor import full_tensor
from toolkit.modules.peft import LoRAGroupedExperts

# transformers' fused expert parameters, in the order its experts modules register them (the order PEFT nests in).
FUSED = ("gate_up_proj", "down_proj")
TARGET_PARAMETERS = sorted(f"mlp.experts.{name}" for name in FUSED)  # as PEFT records them: sorted
# PEFT matches modules_to_save against the end of each module's name: the routers of every transformers 5 family.
ROUTER_MODULES = ["mlp.gate"]
_NESTING = {"gate_up_proj": "base_layer.", "down_proj": ""}
# Where each of our stacked projections lies in transformers' fused parameters: (parameter, row block, blocks).
_IN_FUSED = {"gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2), "down_proj": ("down_proj", 0, 1)}
_EXPERTS_MODULE = re.compile(r"(.+\.mlp\.experts)(\.base_layer)?")
_FUSED_TARGET = re.compile(r".+\.mlp\.experts\.(gate_up_proj|down_proj)")


def no_peft_form(modules: dict) -> str | None:
    """Why adapters including expert ones cannot be written as a PEFT adapter that ``peft`` loads, or None."""
    dropout = {module.dropout_p for module in modules.values()}
    if any(isinstance(m, LoRAGroupedExperts) for m in modules.values()) and dropout != {0.0}:
        return (
            f"apply_lora_to_experts: PEFT loads adapters on experts only without dropout, and these were trained with "
            f"lora_dropout={max(dropout)}"
        )
    return None


def hf_moe_name(module_name: str) -> str:
    """A mixture-of-experts block's module's name in a transformers 5 model (the name PEFT adapters use):
    ``layers.0.mlp.experts`` -> ``model.layers.0.mlp.experts``, ``layers.0.mlp.gate`` -> ``model.layers.0.mlp.gate``,
    for every family (checkpoints on disk may name the block otherwise)."""
    return f"model.{module_name}"


def peft_patterns(rank: int, alpha: float) -> tuple[dict, dict]:
    """``rank_pattern`` and ``alpha_pattern`` of an adapter whose experts' adapters have ``rank`` and ``alpha``."""
    return {"gate_up_proj": 2 * rank}, {"gate_up_proj": 2 * alpha}


def whole(param: torch.Tensor) -> torch.Tensor:
    """``param`` whole and detached: gathered where it is a DTensor (a collective: every rank calls it)."""
    return (full_tensor(param) if isinstance(param, DTensor) else param).detach()  # a collective for a DTensor


def peft_tensors(module: LoRAGroupedExperts) -> dict[str, torch.Tensor]:
    """The PEFT tensors of ``module``'s adapters, by name relative to the experts module (``lora_A.weight``,
    ``base_layer.lora_B.weight``...). Sharded adapters are gathered whole, one at a time: every rank calls it."""
    a = {name: whole(module.adapter(name).lora_a.weight) for name in _IN_FUSED}  # [E, r, in]
    b = {name: whole(module.adapter(name).lora_b.weight) for name in _IN_FUSED}  # [E, out, r]
    zeros = torch.zeros_like(b["gate_proj"])
    stacked = {
        "gate_up_proj": (
            torch.cat([a["gate_proj"], a["up_proj"]], dim=1),  # [E, 2r, H]
            torch.cat([torch.cat([b["gate_proj"], zeros], dim=2), torch.cat([zeros, b["up_proj"]], dim=2)], dim=1),
        ),
        "down_proj": (a["down_proj"], b["down_proj"]),
    }
    tensors = {}
    for name, (lora_a, lora_b) in stacked.items():
        experts, out_dim, rank = lora_b.shape
        tensors[f"{_NESTING[name]}lora_A.weight"] = lora_a.reshape(experts * rank, -1).contiguous()
        tensors[f"{_NESTING[name]}lora_B.weight"] = lora_b.permute(1, 2, 0).reshape(out_dim, rank * experts).contiguous()
    return tensors


def fused_target(module: str) -> str | None:
    """The fused parameter a PEFT adapter module of an experts block adapts (``model.layers.0.mlp.experts.
    base_layer`` -> ``model.layers.0.mlp.experts.gate_up_proj``), or None for any other module."""
    match = _EXPERTS_MODULE.fullmatch(module)
    if match is None:
        return None
    return f"{match.group(1)}.{'gate_up_proj' if match.group(2) else 'down_proj'}"


def is_fused(name: str) -> bool:
    """Whether ``name`` (as :func:`fused_target` gives it) is an experts block's fused parameter."""
    return _FUSED_TARGET.fullmatch(name) is not None


def fused_delta(params: dict[str, torch.Tensor], rank: int, scale: float) -> torch.Tensor:
    """``scale * B_e A_e`` of every expert of one fused parameter's PEFT adapter, ``[E, out, in]``, in float32."""
    lora_a, lora_b = params["lora_A.weight"].float(), params["lora_B.weight"].float()
    experts = lora_a.shape[0] // rank
    stacked_a = lora_a.reshape(experts, rank, -1)
    stacked_b = lora_b.reshape(lora_b.shape[0], rank, experts).permute(2, 0, 1)
    return scale * torch.bmm(stacked_b, stacked_a)


def part_of_fused(stacked_key: str) -> tuple[str, int, int]:
    """Where our stacked projection ``layers.0.mlp.experts.gate_proj`` lies in transformers' fused parameters:
    ``("model.layers.0.mlp.experts.gate_up_proj", row block, blocks)``."""
    module, _, name = stacked_key.rpartition(".")
    fused, block, blocks = _IN_FUSED[name]
    return f"{hf_moe_name(module)}.{fused}", block, blocks
