"""``torch.compile`` applied per decoder layer, from outside the model.

Compiling each layer rather than the whole model keeps compile time to that of one layer (every layer runs the
same graph, so it is traced and compiled once), leaves the data-parallel hooks (FSDP2's all-gathers, DDP's
gradient buckets) outside the compiled code, and composes with activation checkpointing.

Tensor-parallel layers are compiled for static shapes: with dynamic shapes, tracing a layer whose weights are
DTensors fails in torch 2.13 (a RecursionError in AOT autograd's proxy tracing, already for one column-wise
``nn.Linear`` under ``parallelize_module``; static shapes trace it). Each new sequence length then compiles
again, so the batches of a compiled TP run are padded to one of :data:`STATIC_LENGTHS` lengths
(:func:`static_lengths`), and each length compiles once.
"""

import importlib.util
import os
import shutil
from collections.abc import Callable

import torch
import torch.nn as nn

from toolkit.errors import UserError

# The most sequence lengths a run compiled for static shapes pads its batches to (dynamo's default recompile
# limit is 8 too; compile_model raises it for these lengths in training and in evaluation, without grad).
STATIC_LENGTHS = 8


def static_lengths(max_seq_len: int, *, multiple: int = 1) -> list[int]:
    """The lengths a run compiled for static shapes pads each batch to (the shortest that holds it): at most
    :data:`STATIC_LENGTHS`, evenly spaced up to ``max_seq_len`` (rounded up to ``multiple``), each a multiple of
    ``multiple``. A batch pads by less than ``max_seq_len / 8`` (rounded up to ``multiple``) tokens per row; padding
    is never a target, so the loss is the same."""
    step = -(-max_seq_len // STATIC_LENGTHS)
    step = -(-step // multiple) * multiple
    top = -(-max_seq_len // multiple) * multiple
    return sorted({min(k * step, top) for k in range(1, STATIC_LENGTHS + 1)})


def _missing_compiler(device_type: str, switch: str = "compile") -> str | None:
    """Why inductor cannot generate code for ``device_type`` here, or None when it can (as far as we can tell
    without compiling); the message names the config ``switch`` that needs it."""
    if device_type == "cpu":
        from torch._inductor import config

        candidates = [cxx for cxx in config.cpp.cxx if cxx]  # honours the CXX environment variable
        if not any(shutil.which(cxx) for cxx in candidates):
            return (
                f"{switch}: torch.compile on the CPU needs a C++ compiler ({' or '.join(candidates)}) and none was "
                f"found on PATH; install one (e.g. apt-get install g++), point CXX at one, or set {switch}=false"
            )
    elif device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return f"{switch}: torch.compile on a GPU needs Triton (pip install triton), or set {switch}=false"
        # Triton builds a small C launcher with $CC, gcc or clang on first use.
        if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")):
            return (
                f"{switch}: Triton needs a C compiler (gcc or clang on PATH, or CC) to build its launcher; install "
                f"one or set {switch}=false"
            )
    return None


def compile_model(
    model: nn.Module,
    *,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    backend: str | Callable = "inductor",
    dynamic: bool | None = None,
) -> Callable[..., torch.Tensor] | None:
    """Compile every decoder layer of ``model`` in place, the work between the matmuls of its fused loss, and
    optionally a loss function.

    Each decoder layer's ``forward`` (:meth:`~toolkit.modules.contract.DecoderModel.decoder_layers`) is replaced by
    its compiled version, so parameter names, state-dict keys and module hooks are unchanged. Apply it to the plain
    model, before data parallelism; before or after :func:`~toolkit.training.apply_activation_checkpointing`
    (after: the checkpoint is compiled with the layer; before: the compiled layer is recomputed in backward).
    Compilation itself happens on the first forward.

    ``nn.Module.compile()`` is not used: it compiles ``Module._call_impl``, a frame Dynamo skips, and once
    activation checkpointing has replaced a layer's ``forward`` (with ``torch.utils.checkpoint``, skipped too)
    nothing is left to compile and the layer silently runs eagerly (seen with torch 2.13).

    Args:
        model: a decoder (:class:`~toolkit.modules.contract.DecoderModel`); its ``output_loss_kernel``, if it has one
            (:func:`~toolkit.modules.loss.logit_loss_and_grad`), is compiled too: the softmax, the loss and the
            logits' gradient of a chunk in a pass or two, without float32 chunk-sized tensors in memory.
        device: where training runs (checks that the code generator for it is installed).
        loss_fn: a loss to compile too; returned compiled.
        backend: the ``torch.compile`` backend.
        dynamic: ``torch.compile``'s: None compiles the first length statically and then for any length; False
            (tensor-parallel models, see the module docstring) compiles the layers once per length, and raises
            dynamo's recompile limit (a global setting) to :data:`STATIC_LENGTHS` lengths with grad and without:
            pad batches to :func:`static_lengths`, or lengths past the limit run eagerly. The fused loss's kernel,
            on plain tensors, stays dynamic.

    Returns:
        ``loss_fn`` compiled, or None when none was given.

    Raises:
        UserError: the compiler that ``inductor`` needs for ``device`` (a C++ compiler on the CPU, Triton on a
            GPU) is missing; raised here rather than at the first forward, deep inside a traceback.
    """
    if backend == "inductor":
        problem = _missing_compiler(device.type)
        if problem is not None:
            raise UserError(problem)
    if dynamic is False:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, 2 * STATIC_LENGTHS)
    for layer in model.decoder_layers().values():
        layer.forward = torch.compile(layer.forward, backend=backend, dynamic=dynamic)
    if hasattr(model, "output_loss_kernel"):
        model.output_loss_kernel = torch.compile(model.output_loss_kernel, backend=backend)
    return torch.compile(loss_fn, backend=backend) if loss_fn is not None else None
