"""Mixtral with low-rank adapters: LoRA and DoRA versions of the Mixtral builders (see ``toolkit.models._lora``), on
the attention projections and the output, and with ``apply_lora_to_experts`` LoRA on every expert; the routers stay
frozen unless ``train_router`` trains them whole. No QLoRA yet: the experts, nearly all of the weights, are not
stored in NF4, so ``quantize_base`` is refused."""

from toolkit.models._lora import lora_builder
from toolkit.models.mixtral._component_builders import mixtral
from toolkit.models.mixtral._model_builders import mixtral_8x7b, mixtral_8x22b

lora_mixtral = lora_builder(mixtral)
lora_mixtral_8x7b = lora_builder(mixtral_8x7b)
lora_mixtral_8x22b = lora_builder(mixtral_8x22b)
