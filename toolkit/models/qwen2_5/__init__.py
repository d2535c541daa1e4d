"""Qwen2.5 (and Qwen2): builders, sizes and checkpoint conversion."""

from toolkit.models.qwen2_5._component_builders import qwen2_5
from toolkit.models.qwen2_5._convert_weights import hf_config, hf_key_to_tune, tune_key_to_hf
from toolkit.models.qwen2_5._model_builders import (
    HF_MODEL_TYPES,
    from_hf_config,
    qwen2_5_0_5b,
    qwen2_5_1_5b,
    qwen2_5_3b,
    qwen2_5_7b,
    qwen2_5_14b,
    qwen2_5_32b,
    qwen2_5_72b,
)

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_tune",
    "qwen2_5",
    "qwen2_5_0_5b",
    "qwen2_5_14b",
    "qwen2_5_1_5b",
    "qwen2_5_32b",
    "qwen2_5_3b",
    "qwen2_5_72b",
    "qwen2_5_7b",
    "tune_key_to_hf",
]
