"""Mistral 7B: builders, plain and with adapters (LoRA, DoRA, QLoRA), sizes and checkpoint conversion."""

from toolkit.models.mistral._component_builders import mistral, mistral_attention
from toolkit.models.mistral._convert_weights import hf_config, hf_key_to_tune, tune_key_to_hf
from toolkit.models.mistral._lora_builders import lora_mistral, lora_mistral_7b, qlora_mistral_7b
from toolkit.models.mistral._model_builders import HF_MODEL_TYPES, from_hf_config, mistral_7b

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_tune",
    "lora_mistral",
    "lora_mistral_7b",
    "mistral",
    "mistral_attention",
    "mistral_7b",
    "qlora_mistral_7b",
    "tune_key_to_hf",
]
