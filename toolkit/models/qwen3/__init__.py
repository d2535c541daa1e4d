"""Qwen3 (dense): builders, plain and with adapters (LoRA, DoRA, QLoRA), sizes and checkpoint conversion."""

from toolkit.models.qwen3._component_builders import qwen3, qwen3_attention
from toolkit.models.qwen3._convert_weights import hf_config, hf_key_to_tune, tune_key_to_hf
from toolkit.models.qwen3._lora_builders import (
    lora_qwen3,
    lora_qwen3_0_6b,
    lora_qwen3_1_7b,
    lora_qwen3_4b,
    lora_qwen3_8b,
    lora_qwen3_14b,
    lora_qwen3_32b,
    qlora_qwen3_0_6b,
    qlora_qwen3_1_7b,
    qlora_qwen3_4b,
    qlora_qwen3_8b,
    qlora_qwen3_14b,
    qlora_qwen3_32b,
)
from toolkit.models.qwen3._model_builders import (
    HF_MODEL_TYPES,
    from_hf_config,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_14b,
    qwen3_32b,
)

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_tune",
    "lora_qwen3",
    "lora_qwen3_0_6b",
    "lora_qwen3_14b",
    "lora_qwen3_1_7b",
    "lora_qwen3_32b",
    "lora_qwen3_4b",
    "lora_qwen3_8b",
    "qlora_qwen3_0_6b",
    "qlora_qwen3_14b",
    "qlora_qwen3_1_7b",
    "qlora_qwen3_32b",
    "qlora_qwen3_4b",
    "qlora_qwen3_8b",
    "qwen3",
    "qwen3_attention",
    "qwen3_0_6b",
    "qwen3_14b",
    "qwen3_1_7b",
    "qwen3_32b",
    "qwen3_4b",
    "qwen3_8b",
    "tune_key_to_hf",
]
