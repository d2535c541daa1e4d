"""Gemma 3 with low-rank adapters: LoRA, DoRA and QLoRA versions of the Gemma 3 builders (see
``toolkit.models._lora``). The output projection is the (tied) embedding, so it takes no adapter. ``qlora_*``
builders are the LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.gemma3._component_builders import gemma3
from toolkit.models.gemma3._model_builders import gemma3_1b, gemma3_4b, gemma3_12b, gemma3_27b

lora_gemma3 = lora_builder(gemma3)
lora_gemma3_1b = lora_builder(gemma3_1b)
lora_gemma3_4b = lora_builder(gemma3_4b)
lora_gemma3_12b = lora_builder(gemma3_12b)
lora_gemma3_27b = lora_builder(gemma3_27b)

qlora_gemma3_1b = qlora(lora_gemma3_1b)
qlora_gemma3_4b = qlora(lora_gemma3_4b)
qlora_gemma3_12b = qlora(lora_gemma3_12b)
qlora_gemma3_27b = qlora(lora_gemma3_27b)
