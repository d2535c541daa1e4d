"""Qwen3-MoE with low-rank adapters: LoRA, DoRA and QLoRA versions of the Qwen3-MoE builders (see
``toolkit.models._lora``), on the attention projections and the output (and the feed-forward of dense layers), and
with ``apply_lora_to_experts`` LoRA on every expert; the routers stay frozen unless ``train_router`` trains them
whole. ``qlora_*`` builders are the LoRA builders with ``quantize_base=True``: the experts too are stored in NF4,
one quantization per expert (``toolkit.modules.peft.NF4Stack``)."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.qwen3_moe._component_builders import qwen3_moe
from toolkit.models.qwen3_moe._model_builders import qwen3_moe_30b_a3b, qwen3_moe_235b_a22b

lora_qwen3_moe = lora_builder(qwen3_moe)
lora_qwen3_moe_30b_a3b = lora_builder(qwen3_moe_30b_a3b)
lora_qwen3_moe_235b_a22b = lora_builder(qwen3_moe_235b_a22b)

qlora_qwen3_moe_30b_a3b = qlora(lora_qwen3_moe_30b_a3b)
qlora_qwen3_moe_235b_a22b = qlora(lora_qwen3_moe_235b_a22b)
