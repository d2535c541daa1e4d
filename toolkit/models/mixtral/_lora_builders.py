"""Mixtral with low-rank adapters: LoRA, DoRA and QLoRA versions of the Mixtral builders (see
``toolkit.models._lora``), on the attention projections and the output, and with ``apply_lora_to_experts`` LoRA on
every expert; the routers stay frozen unless ``train_router`` trains them whole. ``qlora_*`` builders are the LoRA
builders with ``quantize_base=True``: the experts too are stored in NF4, one quantization per expert
(``toolkit.modules.peft.NF4Stack``)."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.mixtral._component_builders import mixtral
from toolkit.models.mixtral._model_builders import mixtral_8x7b, mixtral_8x22b

lora_mixtral = lora_builder(mixtral)
lora_mixtral_8x7b = lora_builder(mixtral_8x7b)
lora_mixtral_8x22b = lora_builder(mixtral_8x22b)

qlora_mixtral_8x7b = qlora(lora_mixtral_8x7b)
qlora_mixtral_8x22b = qlora(lora_mixtral_8x22b)
