"""Qwen3-MoE: builders, plain and with adapters (LoRA, DoRA, QLoRA with NF4 experts), sizes and checkpoint
conversion."""

from toolkit.models.qwen3_moe._component_builders import qwen3_moe, sparse_layers
from toolkit.models.qwen3_moe._convert_weights import (
    hf_config,
    hf_key_to_parts,
    hf_key_to_tune,
    tune_key_to_hf,
    tune_key_to_hf_slices,
)
from toolkit.models.qwen3_moe._lora_builders import (
    lora_qwen3_moe,
    lora_qwen3_moe_30b_a3b,
    lora_qwen3_moe_235b_a22b,
    qlora_qwen3_moe_30b_a3b,
    qlora_qwen3_moe_235b_a22b,
)
from toolkit.models.qwen3_moe._model_builders import (
    HF_MODEL_TYPES,
    from_hf_config,
    qwen3_moe_30b_a3b,
    qwen3_moe_235b_a22b,
)

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_parts",
    "hf_key_to_tune",
    "lora_qwen3_moe",
    "lora_qwen3_moe_235b_a22b",
    "lora_qwen3_moe_30b_a3b",
    "qlora_qwen3_moe_235b_a22b",
    "qlora_qwen3_moe_30b_a3b",
    "qwen3_moe",
    "qwen3_moe_235b_a22b",
    "qwen3_moe_30b_a3b",
    "sparse_layers",
    "tune_key_to_hf",
    "tune_key_to_hf_slices",
]
