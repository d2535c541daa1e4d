"""Precision policies, chosen by the config's ``dtype``.

| dtype       | stored parameters | compute | gradient reduction | loss scaling |
|-------------|-------------------|---------|--------------------|--------------|
| fp32        | fp32              | fp32    | fp32               | no           |
| bf16        | bf16              | bf16    | bf16               | no           |
| bf16-mixed  | fp32 (master)     | bf16    | fp32               | no           |
| fp16-mixed  | fp32 (master)     | fp16    | fp32               | yes          |

Mixed modes cast per layer at gather time under FSDP2 (``MixedPrecisionPolicy``) and use ``torch.autocast``
otherwise (one process, DDP, ZeRO-1).
"""

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from toolkit.errors import UserError


@dataclass(frozen=True)
class PrecisionPolicy:
    """What ``dtype`` means for storage, compute and reduction."""

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype

    @property
    def is_mixed(self) -> bool:
        return self.param_dtype != self.compute_dtype

    @property
    def needs_grad_scaler(self) -> bool:
        return self.compute_dtype == torch.float16

    def fsdp_policy(self) -> MixedPrecisionPolicy:
        """FSDP2's policy: gather parameters in the compute dtype, reduce gradients in the stored dtype."""
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.param_dtype)

    def autocast(self, device: torch.device, *, sharded: bool) -> contextlib.AbstractContextManager:
        """The forward-pass context: autocast for mixed modes without FSDP2 (which casts by itself)."""
        if not self.is_mixed or sharded:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute_dtype)


_POLICIES = {
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "fp16-mixed": (torch.float32, torch.float16),
}
PRECISIONS = tuple(_POLICIES)  # the values of the config's `dtype`


def precision_policy(dtype: str, *, device: torch.device) -> PrecisionPolicy:
    """The policy named ``dtype``, checked against ``device``.

    Raises:
        UserError: an unknown name, or bf16 on a GPU without bf16 support.
    """
    if dtype not in _POLICIES:
        raise UserError(f"dtype: unknown value {dtype!r}; choose one of {', '.join(_POLICIES)}")
    param, compute = _POLICIES[dtype]
    if compute == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(
            f"dtype: {dtype} needs bf16, which {torch.cuda.get_device_name(device)} lacks; use fp16-mixed or fp32"
        )
    return PrecisionPolicy(dtype, param, compute)

