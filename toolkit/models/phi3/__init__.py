"""Phi-3 architecture (Phi-4, Phi-4-mini, Phi-3.5-mini): builders, plain and with adapters (LoRA, DoRA, QLoRA),
sizes and checkpoint conversion (Hugging Face's fused ``qkv_proj`` and ``gate_up_proj`` split on load and joined on
export)."""

from toolkit.models.phi3._component_builders import phi3
from toolkit.models.phi3._convert_weights import hf_config, hf_key_to_parts, hf_key_to_tune, tune_key_to_hf
from toolkit.models.phi3._lora_builders import (
    lora_phi3,
    lora_phi4_14b,
    lora_phi4_mini,
    qlora_phi4_14b,
    qlora_phi4_mini,
)
from toolkit.models.phi3._model_builders import HF_MODEL_TYPES, from_hf_config, phi4_14b, phi4_mini

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_parts",
    "hf_key_to_tune",
    "lora_phi3",
    "lora_phi4_14b",
    "lora_phi4_mini",
    "phi3",
    "phi4_14b",
    "phi4_mini",
    "qlora_phi4_14b",
    "qlora_phi4_mini",
    "tune_key_to_hf",
]
