"""Phi-3-architecture models with low-rank adapters: LoRA, DoRA and QLoRA versions of the builders (see
``toolkit.models._lora``). Adapters sit on our separate projections (``q_proj``, ``gate_proj``...), which Hugging
Face's checkpoints fuse; the base loads and exports through the fused names. ``qlora_*`` builders are the LoRA
builders with ``quantize_base=True``."""

from toolkit.models._lora import lora_builder, qlora
from toolkit.models.phi3._component_builders import phi3
from toolkit.models.phi3._model_builders import phi4_14b, phi4_mini

lora_phi3 = lora_builder(phi3)
lora_phi4_14b = lora_builder(phi4_14b)
lora_phi4_mini = lora_builder(phi4_mini)

qlora_phi4_14b = qlora(lora_phi4_14b)
qlora_phi4_mini = qlora(lora_phi4_mini)
