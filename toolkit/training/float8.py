"""Float8 matmuls in the linear layers, from torchao (``float8: true``).

torchao's ``Float8Linear`` casts a linear layer's input, weight and output gradient to float8 (e4m3 forward,
e5m2 for gradients) with one dynamic scale per tensor, and runs the three matmuls of forward and backward in
float8; the weights, the optimizer and everything outside the converted layers stay as they were. The float8
tensor cores of GPUs of compute capability 8.9 and newer (Ada, Hopper, Blackwell) run them at twice the peak rate
of bf16 (torchtitan measures +28% tokens/s on Llama 3.1 8B with FSDP and compile); elsewhere they are emulated and
only slower, so :func:`check_float8_device` refuses them. Convert before ``torch.compile`` (which
fuses the casts into neighbouring kernels: float8 needs compile to pay off) and before FSDP2 shards the model, which
then all-gathers the converted weights in float8: half the bytes of a bf16 all-gather.

LoRA's frozen base weights belong to their LoRA layers, not to ``nn.Linear`` layers; their two matmuls (forward and
input gradient: most of a LoRA step) run in float8 through
:func:`~toolkit.modules.peft.float8_base.float8_frozen_linear`, with the same scaling. They are gathered in bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.errors import UserError
from toolkit.modules.peft.lora import LoRALinear

# Ada (8.9) and Hopper (9.0) were the first with float8 tensor cores; torch._scaled_mm needs one of them or newer.
MIN_CAPABILITY = (8, 9)
# CUDA's float8 matmul wants both dimensions it contracts over multiples of 16; a weight's gradient contracts over the
# tokens, so a float8 recipe pads each row's length to a multiple of this (times its shards' count under sequence or
# context parallelism) and every rank's token count is one too.
FLOAT8_TOKEN_MULTIPLE = 16


def check_float8_device(device: torch.device) -> None:
    """Refuse float8 training on a device without float8 tensor cores.

    Raises:
        UserError: ``device`` is not a CUDA GPU of compute capability 8.9 or newer.
    """
    needs = "float8: needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell)"
    if device.type != "cuda":
        raise UserError(f"{needs}; this run is on the {device.type}; set float8=false")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise UserError(
            f"{needs}; {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}; set float8=false"
        )


def is_float8_linear(module: nn.Module, fqn: str) -> bool:
    """Whether :func:`apply_float8` converts ``module`` (named ``fqn`` in the model).

    Every ``nn.Linear`` whose dimensions are both multiples of 16 (what float8 matmuls require), except the output
    projection, whose logits feed the loss over a vocabulary-sized softmax (torchtitan keeps it in bf16 as well),
    and LoRA's ``lora_a``/``lora_b``, rank-sized matrices too small to gain. LoRA layers are
    :func:`is_float8_lora_base`'s.
    """
    if not isinstance(module, nn.Linear) or fqn == "output" or fqn.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
        return False
    return _float8_shape(module.weight)


def is_float8_lora_base(module: nn.Module, fqn: str) -> bool:
    """Whether :func:`apply_float8` runs ``module``'s frozen base in float8: a LoRA layer (not DoRA, whose weight
    norm needs the base in full precision, nor QLoRA's NF4 base, already dequantized on the fly) other than the
    output projection, with both dimensions multiples of 16."""
    return (type(module) is LoRALinear and not module.quantize_base and fqn != "output"
            and _float8_shape(module.weight))


def _float8_shape(weight: torch.Tensor) -> bool:
    out_features, in_features = weight.shape
    return in_features % 16 == 0 and out_features % 16 == 0


def apply_float8(model: nn.Module, *, fsdp_float8_all_gather: bool) -> list[str]:
    """Swap, in place, the linear layers :func:`is_float8_linear` selects for torchao's ``Float8Linear``
    (tensorwise dynamic scaling), and run the frozen bases of the LoRA layers :func:`is_float8_lora_base` selects
    in float8. Parameter names and state-dict keys do not change, so checkpoints load as before.

    Args:
        model: the model, on the meta device or materialized, before compile and data parallelism.
        fsdp_float8_all_gather: FSDP2 will shard the model: all-gather the weights in float8, cast once per shard.

    Returns:
        The names of the converted layers, in module order.

    Raises:
        UserError: no layer qualifies (a QLoRA model with adapters on every projection, for instance).
    """
    converted, bases = [], []
    for name, module in model.named_modules():
        if is_float8_lora_base(module, name):
            bases.append(module)
        elif not is_float8_linear(module, name):
            continue
        converted.append(name)
    if not converted:
        raise UserError(
            "float8: no linear layer of this model can compute in float8 (the output projection, DoRA layers and "
            "QLoRA's NF4 bases stay as they are, and both dimensions must be multiples of 16); set float8=false"
        )
    for module in bases:
        module.float8_base = True
    if len(bases) < len(converted):  # plain linear layers too
        with torch.device("cpu"):  # imported only when needed, outside the meta device (see nf4._torchao_quantization)
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
        convert_to_float8_training(model, module_filter_fn=is_float8_linear, config=config)
    return converted
