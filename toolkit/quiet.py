"""Third-party start-up noise, hidden unless asked for with ``TUNE_VERBOSE=1``.

Importing torchao (for QLoRA, 8-bit optimizers, float8, or through peft) logs a line for each of its C++ extensions
that this machine's torch or GPU cannot load, and torch's pytree logs a deprecation for each enum torchao registers:
a dozen lines a user can do nothing about, printed before the first line of their run. Only these named messages of
these named loggers (and one named Python warning) are dropped, by a filter on the logger, so everything else they
log, every warning of ours and every error still shows; ``TUNE_VERBOSE=1`` (which also shows torchrun's own logs)
keeps them too.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Mapping

VERBOSE_ENV = "TUNE_VERBOSE"

# Logger name -> the messages of it that are noise (matched from the start of the message).
NOISE = {
    # torchao's prebuilt kernels for GPUs or torch builds other than this one's; the Python paths still work.
    "torchao": re.compile(r"Failed to load .*\.so\b|Skipping import of cpp extensions"),
    # torchao's int8 matmul kernels on a machine without Triton (a CPU one); toolkit says itself where Triton is needed.
    "torchao.kernel.intmm": re.compile(r"Warning: Detected no triton"),
    # torch >= 2.12 on torchao registering its enums the older way (torchao's to change, not the user's).
    "torch.utils._pytree": re.compile(r".* is an Enum subclass and is now natively supported by torch\.compile"),
}

# Python warnings that are noise, by message: torch asking torchao's tensor subclasses (the 8-bit optimizers' state)
# for a method of theirs, once per process, when the optimizer step is compiled.
WARNING_NOISE = (r".* does not implement _stable_hash_for_caching",)


class _DropNoise(logging.Filter):
    """Drops a logger's records whose message matches its pattern."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def verbose(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user asked to see everything (``TUNE_VERBOSE=1``)."""
    return (os.environ if environ is None else environ).get(VERBOSE_ENV) == "1"


def quiet_third_party_noise(environ: Mapping[str, str] | None = None) -> None:
    """Hide :data:`NOISE` in this process from now on (once; nothing without ``TUNE_VERBOSE=1``). Call it before
    the noisy packages are imported: ``tune`` and every recipe's entry point do."""
    if verbose(environ):
        return
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))
    for message in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
