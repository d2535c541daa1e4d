"""Llama 2: builders and sizes, plain and with adapters (LoRA, DoRA, QLoRA). Checkpoints convert exactly as
Llama 3's (Hugging Face and Meta layouts)."""

from toolkit.models.llama2._component_builders import llama2
from toolkit.models.llama2._lora_builders import (
    lora_llama2,
    lora_llama2_7b,
    lora_llama2_13b,
    lora_llama2_70b,
    qlora_llama2_7b,
    qlora_llama2_13b,
    qlora_llama2_70b,
)
from toolkit.models.llama2._model_builders import llama2_7b, llama2_13b, llama2_70b
from toolkit.models.llama3._convert_weights import (
    hf_config,
    hf_key_to_tune,
    hf_to_tune,
    meta_to_tune,
    tune_key_to_hf,
    tune_to_hf,
    tune_to_meta,
)

__all__ = [
    "hf_config",
    "hf_key_to_tune",
    "hf_to_tune",
    "llama2",
    "llama2_13b",
    "llama2_70b",
    "llama2_7b",
    "lora_llama2",
    "lora_llama2_13b",
    "lora_llama2_70b",
    "lora_llama2_7b",
    "meta_to_tune",
    "qlora_llama2_13b",
    "qlora_llama2_70b",
    "qlora_llama2_7b",
    "tune_key_to_hf",
    "tune_to_hf",
    "tune_to_meta",
]
