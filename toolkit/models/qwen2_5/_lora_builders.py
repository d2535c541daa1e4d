"""Qwen2.5 with low-rank adapters: LoRA, DoRA and QLoRA versions of the Qwen2.5 builders (see
``toolkit.models._lora``); the query, key and value biases stay frozen with the base. ``qlora_*`` builders are the
LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.qwen2_5._component_builders import qwen2_5
from toolkit.models.qwen2_5._model_builders import (
    qwen2_5_0_5b,
    qwen2_5_1_5b,
    qwen2_5_3b,
    qwen2_5_7b,
    qwen2_5_14b,
    qwen2_5_32b,
    qwen2_5_72b,
)

lora_qwen2_5 = lora_builder(qwen2_5)
lora_qwen2_5_0_5b = lora_builder(qwen2_5_0_5b)
lora_qwen2_5_1_5b = lora_builder(qwen2_5_1_5b)
lora_qwen2_5_3b = lora_builder(qwen2_5_3b)
lora_qwen2_5_7b = lora_builder(qwen2_5_7b)
lora_qwen2_5_14b = lora_builder(qwen2_5_14b)
lora_qwen2_5_32b = lora_builder(qwen2_5_32b)
lora_qwen2_5_72b = lora_builder(qwen2_5_72b)

qlora_qwen2_5_0_5b = qlora(lora_qwen2_5_0_5b)
qlora_qwen2_5_1_5b = qlora(lora_qwen2_5_1_5b)
qlora_qwen2_5_3b = qlora(lora_qwen2_5_3b)
qlora_qwen2_5_7b = qlora(lora_qwen2_5_7b)
qlora_qwen2_5_14b = qlora(lora_qwen2_5_14b)
qlora_qwen2_5_32b = qlora(lora_qwen2_5_32b)
qlora_qwen2_5_72b = qlora(lora_qwen2_5_72b)
