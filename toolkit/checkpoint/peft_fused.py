"""PEFT adapters of families whose Hugging Face checkpoints fuse projections we keep apart (Phi-3: ``qkv_proj`` is
our ``q_proj``, ``k_proj`` and ``v_proj``; ``gate_up_proj`` our ``gate_proj`` and ``up_proj``).

PEFT adapts the fused module, so our adapters are written as one LoRA on it, exactly: its ``lora_A`` stacks our
``A`` matrices along the rank (``[r_q + r_k + r_v, in]``) and its ``lora_B`` places our ``B`` matrices block-diagonally
(``[q_out + k_out + v_out, r_q + r_k + r_v]``), so that ``B_fused @ A_fused`` is our deltas stacked along the rows; a
projection without adapter has no block (its rows of ``B_fused`` are zero). DoRA's magnitudes are per output row,
and each row's norm is the one of its own projection, so they stack too. PEFT gives every module of an adapter one
rank (short of ``rank_pattern``, which only PEFT itself reads back), so every adapter is written with the largest
such rank, zero-padded (exact: the padded rows of ``A`` meet zero columns of ``B``), and ``lora_alpha`` scaled with
it, keeping ``lora_alpha / r`` ours. Such adapters are for ``peft`` and ``tune merge``; loading them back into our
separate projections is refused (a fused adapter trained by PEFT has no such split).
"""

from typing import Any

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.modules.peft import DoRALinear
from toolkit.checkpoint.peft_experts import whole

def fused_members(family: Any, hf_module: str) -> list[str] | None:
    """Our module names whose rows a fused HF module holds, in order, or ``None`` for a module HF keeps whole."""
    parts = getattr(family, "hf_key_to_parts", lambda key: None)(f"{hf_module}.weight")
    if not parts or len(parts) < 2 or any(part.index is not None for part in parts):
        return None  # whole, or an expert's slice (the experts' adapters are toolkit.checkpoint.peft_experts')
    return [part.key.removesuffix(".weight") for part in parts]


def peft_rank(groups: dict[str, dict[str, nn.Module]], rank: int) -> int:
    """The rank every module of the adapter is written with: the largest sum of our ranks in one HF module."""
    return rank * max(len(modules) for modules in groups.values())


def peft_tensors(
    model: nn.Module, hf_module: str, members: list[str] | None, modules: dict[str, nn.Module], width: int
) -> dict[str, torch.Tensor]:
    """PEFT's tensors (``lora_A.weight``...) of the HF module ``hf_module``, written at rank ``width`` from our adapter
    layers ``modules`` (by our module name) that it holds; ``members``: all of its projections, in row order
    (:func:`fused_members`), or ``None`` for a module HF keeps whole. Sharded adapters are gathered whole (a
    collective for DTensors: every rank calls it).

    Raises:
        UserError: DoRA on some projections of a fused module only (its other rows' magnitudes would be their base
            weights' norms, which the adapter does not hold).
    """
    members = members or list(modules)
    a_blocks, b_blocks, magnitudes, col = [], [], [], 0
    outs = [model.get_submodule(name).weight.shape[0] for name in members]
    dora = any(isinstance(m, DoRALinear) for m in modules.values())
    if dora and len(modules) != len(members):
        raise UserError(
            f"{hf_module}: DoRA on {sorted(n.rpartition('.')[2] for n in modules)} only cannot be written as PEFT's "
            f"DoRA on the fused module; adapt all of {[n.rpartition('.')[2] for n in members]}, or export the merged "
            "model"
        )
    for name, out in zip(members, outs):
        module = modules.get(name)
        if module is None:
            continue
        a, b = whole(module.lora_a.weight), whole(module.lora_b.weight)
        a_blocks.append(a)
        b_blocks.append((sum(outs[: members.index(name)]), col, b))
        col += a.shape[0]
        if dora:
            magnitudes.append(whole(module.magnitude))
    first = a_blocks[0]
    lora_a = first.new_zeros(width, first.shape[1])
    lora_a[:col] = torch.cat(a_blocks)
    lora_b = first.new_zeros(sum(outs), width)
    for row, start, b in b_blocks:
        lora_b[row : row + b.shape[0], start : start + b.shape[1]] = b
    tensors = {"lora_A.weight": lora_a, "lora_B.weight": lora_b}
    if dora:
        tensors["lora_magnitude_vector"] = torch.cat(magnitudes)
    return {key: tensor.contiguous().cpu() for key, tensor in tensors.items()}


def refuse_fused(family: Any, family_name: str, hf_modules: list[str], what: str) -> None:
    """Refuse to load a PEFT adapter into our projections where the family fuses them in Hugging Face's layout.

    Raises:
        UserError: naming the fused module.
    """
    fused = next((m for m in hf_modules if fused_members(family, m) is not None), None)
    if fused is not None:
        raise UserError(
            f"{what}: {family_name} adapters on the fused {fused.rpartition('.')[2]} cannot be loaded into our "
            "separate projections; merge the adapter into its base (tune merge) and use the merged model"
        )
