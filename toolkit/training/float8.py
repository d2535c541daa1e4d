"""Float8 matmuls in the linear layers, from torchao (``float8: true``).

torchao's ``Float8Linear`` casts a linear layer's input, weight and output gradient to float8 (e4m3 forward,
e5m2 for gradients) with one dynamic scale per tensor, and runs the three matmuls of forward and backward in
float8; the weights, the optimizer and everything outside the converted layers stay as they were. The float8
tensor cores of GPUs of compute capability 8.9 and newer (Ada, Hopper, Blackwell) run them at twice the peak rate
of bf16 (torchtitan measures +28% tokens/s on Llama 3.1 8B with FSDP and compile); elsewhere they are emulated and
only slower, so :func:`check_float8_device` refuses them. Convert before ``torch.compile`` (which
fuses the casts into neighbouring kernels: float8 needs compile to pay off) and before FSDP2 shards the model, which
then all-gathers the converted weights in float8: half the bytes of a bf16 all-gather.
"""

from __future__ import annotations

import torch
from torch import nn

from toolkit.errors import UserError

# Ada (8.9) and Hopper (9.0) were the first with float8 tensor cores; torch._scaled_mm needs one of them or newer.
MIN_CAPABILITY = (8, 9)


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
    and LoRA's ``lora_a``/``lora_b``, rank-sized matrices too small to gain. LoRA's and QLoRA's frozen base
    weights are not ``nn.Linear`` layers and stay as they are.
    """
    if not isinstance(module, nn.Linear) or fqn == "output" or fqn.rsplit(".", 1)[-1] in ("lora_a", "lora_b"):
        return False
    out_features, in_features = module.weight.shape
    return in_features % 16 == 0 and out_features % 16 == 0


def apply_float8(model: nn.Module, *, fsdp_float8_all_gather: bool) -> list[str]:
    """Swap, in place, the linear layers :func:`is_float8_linear` selects for torchao's ``Float8Linear``
    (tensorwise dynamic scaling). Parameter names and state-dict keys do not change, so checkpoints load as before.

    Args:
        model: the model, on the meta device or materialized, before compile and data parallelism.
        fsdp_float8_all_gather: FSDP2 will shard the model: all-gather the weights in float8, cast once per shard.

    Returns:
        The names of the converted layers.

    Raises:
        UserError: no layer qualifies (a LoRA model with adapters on every projection, for instance).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # imported only when asked for

    converted = [name for name, module in model.named_modules() if is_float8_linear(module, name)]
    if not converted:
        raise UserError(
            "float8: no linear layer of this model can compute in float8 (adapted LoRA layers and the output "
            "projection stay as they are, and both dimensions must be multiples of 16); set float8=false"
        )
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    convert_to_float8_training(model, module_filter_fn=is_float8_linear, config=config)
    return converted
