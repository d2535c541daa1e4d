"""Parameter and compute dtypes, chosen by the config's ``dtype``."""

import torch

from toolkit.errors import UserError

_PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def param_dtype(dtype: str, *, device: torch.device) -> torch.dtype:
    """The dtype parameters are stored in for ``dtype`` (``fp32`` or ``bf16``).

    Raises:
        UserError: an unknown name, or ``bf16`` on a GPU without bf16 support.
    """
    if dtype not in _PARAM_DTYPES:
        raise UserError(f"dtype: unknown value {dtype!r}; choose one of {', '.join(_PARAM_DTYPES)}")
    if dtype == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UserError(f"dtype: bf16 is not supported on {torch.cuda.get_device_name(device)}; use fp32")
    return _PARAM_DTYPES[dtype]
