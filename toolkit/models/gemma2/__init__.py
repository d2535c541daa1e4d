"""Gemma 2: builders, plain and with adapters (LoRA, DoRA, QLoRA), sizes and checkpoint conversion."""

from toolkit.models.gemma2._component_builders import gemma2, gemma2_mlp
from toolkit.models.gemma2._convert_weights import hf_config, hf_key_to_tune, tune_key_to_hf
from toolkit.models.gemma2._lora_builders import (
    lora_gemma2,
    lora_gemma2_2b,
    lora_gemma2_9b,
    lora_gemma2_27b,
    qlora_gemma2_2b,
    qlora_gemma2_9b,
    qlora_gemma2_27b,
)
from toolkit.models.gemma2._model_builders import HF_MODEL_TYPES, from_hf_config, gemma2_2b, gemma2_9b, gemma2_27b

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "gemma2",
    "gemma2_27b",
    "gemma2_2b",
    "gemma2_9b",
    "gemma2_mlp",
    "hf_config",
    "hf_key_to_tune",
    "lora_gemma2",
    "lora_gemma2_27b",
    "lora_gemma2_2b",
    "lora_gemma2_9b",
    "qlora_gemma2_27b",
    "qlora_gemma2_2b",
    "qlora_gemma2_9b",
    "tune_key_to_hf",
]
