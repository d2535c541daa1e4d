"""Gemma 3 (text): builders, plain and with adapters (LoRA, DoRA, QLoRA), sizes and checkpoint conversion, for
the text-only 1B and the language model of the multimodal 4B, 12B and 27B."""

from toolkit.models.gemma3._component_builders import gemma3, is_global_layer
from toolkit.models.gemma3._convert_weights import hf_config, hf_key_to_tune, skipped_hf_key, tune_key_to_hf
from toolkit.models.gemma3._lora_builders import (
    lora_gemma3,
    lora_gemma3_1b,
    lora_gemma3_4b,
    lora_gemma3_12b,
    lora_gemma3_27b,
    qlora_gemma3_1b,
    qlora_gemma3_4b,
    qlora_gemma3_12b,
    qlora_gemma3_27b,
)
from toolkit.models.gemma3._model_builders import (
    HF_MODEL_TYPES,
    from_hf_config,
    gemma3_1b,
    gemma3_4b,
    gemma3_12b,
    gemma3_27b,
)

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "gemma3",
    "gemma3_12b",
    "gemma3_1b",
    "gemma3_27b",
    "gemma3_4b",
    "hf_config",
    "hf_key_to_tune",
    "is_global_layer",
    "lora_gemma3",
    "lora_gemma3_12b",
    "lora_gemma3_1b",
    "lora_gemma3_27b",
    "lora_gemma3_4b",
    "qlora_gemma3_12b",
    "qlora_gemma3_1b",
    "qlora_gemma3_27b",
    "qlora_gemma3_4b",
    "skipped_hf_key",
    "tune_key_to_hf",
]
