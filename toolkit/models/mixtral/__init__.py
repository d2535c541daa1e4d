"""Mixtral: builders, plain and with adapters (LoRA, DoRA, QLoRA with NF4 experts), sizes and checkpoint
conversion."""

from toolkit.models.mixtral._component_builders import mixtral
from toolkit.models.mixtral._convert_weights import (
    hf_config,
    hf_key_to_parts,
    hf_key_to_tune,
    tune_key_to_hf,
    tune_key_to_hf_slices,
)
from toolkit.models.mixtral._lora_builders import (
    lora_mixtral,
    lora_mixtral_8x7b,
    lora_mixtral_8x22b,
    qlora_mixtral_8x7b,
    qlora_mixtral_8x22b,
)
from toolkit.models.mixtral._model_builders import HF_MODEL_TYPES, from_hf_config, mixtral_8x7b, mixtral_8x22b

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_parts",
    "hf_key_to_tune",
    "lora_mixtral",
    "lora_mixtral_8x22b",
    "lora_mixtral_8x7b",
    "mixtral",
    "mixtral_8x22b",
    "mixtral_8x7b",
    "qlora_mixtral_8x22b",
    "qlora_mixtral_8x7b",
    "tune_key_to_hf",
    "tune_key_to_hf_slices",
]
