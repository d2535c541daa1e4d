"""Phi-3 architecture (Phi-4): builders, plain and with adapters (LoRA, DoRA, QLoRA), sizes and checkpoint
conversion (Hugging Face's fused ``qkv_proj`` and ``gate_up_proj`` split on load and joined on export)."""

from toolkit.models.phi3._component_builders import phi3
from toolkit.models.phi3._convert_weights import hf_config, hf_key_to_parts, hf_key_to_tune, tune_key_to_hf
from toolkit.models.phi3._lora_builders import lora_phi3, lora_phi4_14b, qlora_phi4_14b
from toolkit.models.phi3._model_builders import HF_MODEL_TYPES, from_hf_config, phi4_14b

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_parts",
    "hf_key_to_tune",
    "lora_phi3",
    "lora_phi4_14b",
    "phi3",
    "phi4_14b",
    "qlora_phi4_14b",
    "tune_key_to_hf",
]
