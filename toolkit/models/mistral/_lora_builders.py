"""Mistral with low-rank adapters: LoRA, DoRA and QLoRA versions of the Mistral builders (see
``toolkit.models._lora``). ``qlora_*`` builders are the LoRA builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.mistral._component_builders import mistral
from toolkit.models.mistral._model_builders import mistral_7b

lora_mistral = lora_builder(mistral)
lora_mistral_7b = lora_builder(mistral_7b)

qlora_mistral_7b = qlora(lora_mistral_7b)
