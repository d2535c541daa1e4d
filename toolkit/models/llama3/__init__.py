"""Llama 3, 3.1, 3.2 and 3.3: builders, sizes and checkpoint conversion."""

from toolkit.models.llama3._component_builders import llama3, llama3_mlp
from toolkit.models.llama3._convert_weights import (
    hf_config,
    hf_key_to_tune,
    hf_to_tune,
    meta_to_tune,
    tune_key_to_hf,
    tune_to_hf,
    tune_to_meta,
)
from toolkit.models.llama3._model_builders import (
    HF_MODEL_TYPES,
    from_hf_config,
    llama3_1_8b,
    llama3_1_70b,
    llama3_2_1b,
    llama3_2_3b,
    llama3_3_70b,
    llama3_demo,
)

__all__ = [
    "HF_MODEL_TYPES",
    "from_hf_config",
    "hf_config",
    "hf_key_to_tune",
    "hf_to_tune",
    "llama3",
    "llama3_1_70b",
    "llama3_1_8b",
    "llama3_2_1b",
    "llama3_2_3b",
    "llama3_3_70b",
    "llama3_demo",
    "llama3_mlp",
    "meta_to_tune",
    "tune_key_to_hf",
    "tune_to_hf",
    "tune_to_meta",
]
