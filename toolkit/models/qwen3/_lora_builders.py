"""Qwen3 with low-rank adapters: LoRA, DoRA and QLoRA versions of the Qwen3 builders (see
``toolkit.models._lora``); the per-head query and key norms stay frozen with the base. ``qlora_*`` builders are the
LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.qwen3._component_builders import qwen3
from toolkit.models.qwen3._model_builders import qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b, qwen3_14b, qwen3_32b

lora_qwen3 = lora_builder(qwen3)
lora_qwen3_0_6b = lora_builder(qwen3_0_6b)
lora_qwen3_1_7b = lora_builder(qwen3_1_7b)
lora_qwen3_4b = lora_builder(qwen3_4b)
lora_qwen3_8b = lora_builder(qwen3_8b)
lora_qwen3_14b = lora_builder(qwen3_14b)
lora_qwen3_32b = lora_builder(qwen3_32b)

qlora_qwen3_0_6b = qlora(lora_qwen3_0_6b)
qlora_qwen3_1_7b = qlora(lora_qwen3_1_7b)
qlora_qwen3_4b = qlora(lora_qwen3_4b)
qlora_qwen3_8b = qlora(lora_qwen3_8b)
qlora_qwen3_14b = qlora(lora_qwen3_14b)
qlora_qwen3_32b = qlora(lora_qwen3_32b)
