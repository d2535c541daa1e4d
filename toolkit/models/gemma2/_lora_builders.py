"""Gemma 2 with low-rank adapters: LoRA, DoRA and QLoRA versions of the Gemma 2 builders (see
``toolkit.models._lora``). The output projection is the (tied) embedding, so it takes no adapter. ``qlora_*``
builders are the LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.gemma2._component_builders import gemma2
from toolkit.models.gemma2._model_builders import gemma2_2b, gemma2_9b, gemma2_27b

lora_gemma2 = lora_builder(gemma2)
lora_gemma2_2b = lora_builder(gemma2_2b)
lora_gemma2_9b = lora_builder(gemma2_9b)
lora_gemma2_27b = lora_builder(gemma2_27b)

qlora_gemma2_2b = qlora(lora_gemma2_2b)
qlora_gemma2_9b = qlora(lora_gemma2_9b)
qlora_gemma2_27b = qlora(lora_gemma2_27b)
