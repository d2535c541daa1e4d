"""Parameter-efficient fine-tuning: LoRA (Hu et al., 2021) and DoRA (Liu et al., 2024) layers, NF4 base weights
for QLoRA (Dettmers et al., 2023), and the helpers a recipe needs around them.

A LoRA recipe, in order::

    with torch.device("meta"):
        model = lora_llama3_2_1b(lora_attn_modules=["q_proj", "v_proj"], lora_rank=8, lora_alpha=16)
    materialize(model, device=device, dtype=dtype)
    checkpointer.load(model, ignore_missing=is_adapter_key)  # the base checkpoint has no adapters
    init_adapters(model)                                     # B = 0, DoRA magnitudes from the loaded base
    set_trainable_params(model, get_adapter_params(model))   # everything else frozen
    ...                                                      # train; step checkpoints: get_adapter_state_dict
    save_peft_adapter(model, out_dir, model_family="llama3")  # toolkit.checkpoint.peft
"""

from toolkit.modules.peft.experts import LoRAGroupedExperts, TrainedRouter
from toolkit.modules.peft.lora import DoRALinear, LoRALinear
from toolkit.modules.peft.nf4 import NF4Linear, dequantize, is_nf4, to_nf4
from toolkit.modules.peft.nf4_experts import NF4Stack, has_nf4, nf4_stacks
from toolkit.modules.peft.utils import (
    adapter_modules,
    disable_adapters,
    get_adapter_params,
    get_adapter_state_dict,
    get_merged_state_dict,
    init_adapters,
    is_adapter_key,
    merge_lora_weights,
    set_trainable_params,
    trained_routers,
    training_method,
)

__all__ = [
    "DoRALinear",
    "LoRAGroupedExperts",
    "LoRALinear",
    "NF4Linear",
    "NF4Stack",
    "TrainedRouter",
    "adapter_modules",
    "dequantize",
    "disable_adapters",
    "get_adapter_params",
    "get_adapter_state_dict",
    "get_merged_state_dict",
    "has_nf4",
    "init_adapters",
    "is_adapter_key",
    "is_nf4",
    "merge_lora_weights",
    "nf4_stacks",
    "set_trainable_params",
    "to_nf4",
    "trained_routers",
    "training_method",
]
