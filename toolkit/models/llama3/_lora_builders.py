"""Llama 3 with low-rank adapters: LoRA, DoRA and QLoRA versions of the Llama 3 builders (see
``toolkit.models._lora``). ``qlora_*`` builders are the LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.llama3._component_builders import llama3
from toolkit.models.llama3._model_builders import (
    llama3_1_8b,
    llama3_1_70b,
    llama3_2_1b,
    llama3_2_3b,
    llama3_3_70b,
    llama3_demo,
)

lora_llama3 = lora_builder(llama3)
lora_llama3_demo = lora_builder(llama3_demo)
lora_llama3_2_1b = lora_builder(llama3_2_1b)
lora_llama3_2_3b = lora_builder(llama3_2_3b)
lora_llama3_1_8b = lora_builder(llama3_1_8b)
lora_llama3_1_70b = lora_builder(llama3_1_70b)
lora_llama3_3_70b = lora_builder(llama3_3_70b)

qlora_llama3_demo = qlora(lora_llama3_demo)
qlora_llama3_2_1b = qlora(lora_llama3_2_1b)
qlora_llama3_2_3b = qlora(lora_llama3_2_3b)
qlora_llama3_1_8b = qlora(lora_llama3_1_8b)
qlora_llama3_1_70b = qlora(lora_llama3_1_70b)
qlora_llama3_3_70b = qlora(lora_llama3_3_70b)
