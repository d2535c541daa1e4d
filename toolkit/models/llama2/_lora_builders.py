"""Llama 2 with low-rank adapters: LoRA, DoRA and QLoRA versions of the Llama 2 builders (see
``toolkit.models._lora``). ``qlora_*`` builders are the LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.llama2._component_builders import llama2
from toolkit.models.llama2._model_builders import llama2_7b, llama2_13b, llama2_70b

lora_llama2 = lora_builder(llama2)
lora_llama2_7b = lora_builder(llama2_7b)
lora_llama2_13b = lora_builder(llama2_13b)
lora_llama2_70b = lora_builder(llama2_70b)

qlora_llama2_7b = qlora(lora_llama2_7b)
qlora_llama2_13b = qlora(lora_llama2_13b)
qlora_llama2_70b = qlora(lora_llama2_70b)
