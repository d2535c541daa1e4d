"""Activation memory: recompute decoder layers in backward (checkpointing), or keep what they save for backward in
host memory (offloading). Both are applied to a plain model from outside, like the data-parallel transforms.

| config                             | a decoder layer keeps on the device until its backward  | costs               |
|------------------------------------|---------------------------------------------------------|---------------------|
| ``activation_checkpointing: true`` | its input only; the rest is recomputed in backward      | a second forward    |
| ``activation_checkpointing: k``    | every k-th layer its input only, the others everything  | 1/k of that         |
| ``activation_offloading: true``    | nothing: saved tensors wait in pinned host memory       | overlapped copies   |

With both, only the checkpointed layers' inputs are offloaded: the rest of those layers is recomputed anyway.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from toolkit.errors import UserError
from toolkit.modules.moe import routing_checkpoint_context

log = logging.getLogger(__name__)

# Smaller saved tensors stay on the device: a copy costs a kernel launch and an event each way whatever its size,
# and a layer's large activations (b x s x d and up) are megabytes at any useful sequence length.
DEFAULT_MIN_OFFLOAD_BYTES = 2**20


# --- Activation checkpointing --------------------------------------------------------------------------------------


def checkpoint_interval(activation_checkpointing: bool | int) -> int:
    """The ``activation_checkpointing`` setting as a layer interval: 0 (off), 1 (every layer) or ``k``.

    Raises:
        UserError: anything but true, false or a positive integer.
    """
    if isinstance(activation_checkpointing, bool):
        return int(activation_checkpointing)
    if isinstance(activation_checkpointing, int) and activation_checkpointing >= 1:
        return activation_checkpointing
    raise UserError(
        "activation_checkpointing: must be true (every layer), false, or a positive integer k (every k-th layer); "
        f"got {activation_checkpointing!r}"
    )


def checkpointed_layers(num_layers: int, every_k_layers: int) -> range:
    """Indices of the layers :func:`apply_activation_checkpointing` wraps: 0, k, 2k, ... (none for k = 0)."""
    return range(0, num_layers, every_k_layers) if every_k_layers else range(0)


def apply_activation_checkpointing(model: nn.Module, *, every_k_layers: int = 1) -> None:
    """Recompute every ``every_k_layers``-th decoder layer's activations in backward instead of storing them.

    Uses non-reentrant checkpointing, which works with DDP, FSDP2 and frozen parameters (the reentrant variant
    is what raises DDP's "Expected to mark a variable ready only once"). The layer's ``forward`` is wrapped in
    place, so parameter names and state-dict keys do not change. Apply before data parallelism. The layers are the
    model's :meth:`~toolkit.modules.contract.DecoderModel.decoder_layers`, counted in the order they run.

    Run eagerly, the checkpoint carries :func:`~toolkit.modules.moe.routing_checkpoint_context`, so that a
    mixture-of-experts layer recomputed under routing replay takes the experts of its first forward.
    """
    layers = list(model.decoder_layers().values())
    for i in checkpointed_layers(len(layers), every_k_layers):
        layer = layers[i]
        layer.forward = partial(_checkpointed, layer.forward)


def _checkpointed(forward: Callable, *args, **kwargs):
    # torch.compile traces a checkpoint only with the default context_fn (or one of dispatch modes); routing replay
    # does not run compiled.
    if torch.compiler.is_compiling():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=routing_checkpoint_context, **kwargs)


# --- Activation offloading -----------------------------------------------------------------------------------------


class _Kept:
    """A saved tensor left where it is: small, a tensor subclass, or a parameter or buffer (or a view of one),
    whose memory stays on the device whatever is done with the saved reference.

    Registering saved-tensor hooks turns off autograd's check that a saved tensor was not modified in place
    before backward; it is redone here, so such a bug still raises instead of giving wrong gradients.
    """

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        _check_version(self.tensor, self.version)
        return self.tensor


class _Group:
    """The tensors one decoder layer call offloaded. Weak references only: autograd owns the saved tensors."""

    __slots__ = ("previous", "saved", "backward_started", "__weakref__")

    def __init__(self, previous: _Group | None) -> None:
        self.previous = weakref.ref(previous) if previous is not None else None  # the layer that ran before
        self.saved: list[weakref.ref[_Offloaded]] = []
        self.backward_started = False

    def live(self) -> list[_Offloaded]:
        return [s for s in (ref() for ref in self.saved) if s is not None]


class _Offloaded:
    """A saved tensor copied to host memory.

    ``source``, the device tensor, is held until its copy is known to be done (``ActivationOffloader._release``);
    then its device memory can be reused. ``restored`` is the copy brought back for backward.
    """

    __slots__ = ("group", "source", "source_ref", "version", "host", "copied", "modified", "restored",
                 "restored_event", "__weakref__")

    def __init__(
        self, source: torch.Tensor, *, group: _Group, host: torch.Tensor, copied: torch.cuda.Event | None
    ) -> None:
        self.group = group
        self.source: torch.Tensor | None = source
        self.source_ref = weakref.ref(source)
        self.version = source._version
        self.host = host
        self.copied = copied  # marks the end of the copy to ``host`` (None: copied synchronously)
        self.modified = False
        self.restored: torch.Tensor | None = None
        self.restored_event: torch.cuda.Event | None = None


class _ViewOf:
    """Where a view sits in the tensor it views, to take the same view of that tensor's copy."""

    __slots__ = ("size", "stride", "offset")

    def __init__(self, view: torch.Tensor, base: torch.Tensor) -> None:
        self.size, self.stride = view.size(), view.stride()
        self.offset = view.storage_offset() - base.storage_offset()

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """The view of ``tensor``, the viewed tensor itself or a copy of it with the same strides."""
        return tensor.as_strided(self.size, self.stride, tensor.storage_offset() + self.offset)


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` fills its memory without gaps or overlaps in some dimension order: then ``empty_like``
    gives a copy the same strides, and a view of it maps to the same view of the copy."""
    expected = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _check_version(tensor: torch.Tensor, version: int) -> None:
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version {version} "
            "instead (seen by activation offloading's saved-tensor hooks)"
        )


class ActivationOffloader:
    """Saved-tensor hooks that keep a decoder layer's activations in host memory from its forward to its backward.

    Installed around each layer's forward by :meth:`apply`. During the forward, every tensor autograd saves that
    is at least ``min_bytes`` and is not a parameter or buffer of the layer, nor a view of one (their memory stays
    on the device whatever is done with the saved reference), is copied to pinned host memory,
    asynchronously on a side CUDA stream, so the copy overlaps the compute that follows. The device tensor is
    let go once its copy is done: at the latest when the layer after next starts (the compute stream then waits
    for the copy, so its memory is not reused too early), earlier if the copy has already finished. The last
    layers' tensors are usually still held when backward starts and are used as they are, without a round trip.

    In backward, the first use of a layer's tensors starts copying the previous layer's back on the side stream
    (prefetch); each tensor is waited for with an event just before use. A tensor saved several times, or through
    views covering all of it (a layer's input reshaped for q, k and v), is copied once.

    Correctness does not depend on timing: a tensor modified in place after it was saved raises autograd's usual
    error if that happened while it was held (its copy could be racing the write), and otherwise backward uses the
    value it had when saved, which is the right one. Tensor subclasses (NF4, float8) are never copied. Under
    autocast (mixed precision with DDP or ZeRO-1), the low-precision copies of the weights are saved like
    activations and offloaded with them.

    On a device other than CUDA the copy is a plain synchronous copy into a separate CPU tensor. That saves no
    memory (the device is the host); it exists so the bookkeeping can be tested on a CPU-only machine.

    Args:
        device: the device the model computes on.
        min_bytes: smaller saved tensors stay on the device.

    Attributes:
        bytes_offloaded: total bytes copied to the host so far.
        bytes_restored: total bytes copied back to the device so far.
    """

    def __init__(self, *, device: torch.device, min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES) -> None:
        device = torch.device(device)
        cuda = device.type == "cuda"
        if cuda and device.index is None:  # compared with tensors' devices, which always carry an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.min_bytes = min_bytes
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._pin = cuda
        self._group: _Group | None = None  # the layer call being run forward; None between layers
        self._buffers: set[int] = set()  # ids of that layer's buffers
        self._last_group: _Group | None = None
        # A tensor saved again, itself or through a whole view, and unmodified, reuses its first copy.
        self._saved: weakref.WeakValueDictionary[tuple[int, int], _Offloaded] = weakref.WeakValueDictionary()
        self.bytes_offloaded = 0
        self.bytes_restored = 0

    def apply(self, model: nn.Module) -> None:
        """Run every decoder layer's forward under the hooks (``forward`` replaced in place, like checkpointing).

        Apply after :func:`apply_activation_checkpointing` (then only each checkpointed layer's input, saved
        outside the checkpoint's own hooks, is offloaded) and after ``compile_model`` (the hooks must be entered
        outside the compiled code; they then see the tensors the compiled layer saves). Embeddings, the final
        norm, the output projection and the loss run without hooks: their tensors are needed first in backward.
        """
        for layer in model.decoder_layers().values():
            layer.forward = self._wrap(layer, layer.forward)

    def _wrap(self, layer: nn.Module, forward: Callable) -> Callable:
        def offloaded_forward(*args, **kwargs):
            with self._layer_call(layer):
                return forward(*args, **kwargs)

        return offloaded_forward

    @contextlib.contextmanager
    def _layer_call(self, layer: nn.Module) -> Iterator[None]:
        self._group = None  # started at the first tensor saved: nothing to track under no_grad
        self._buffers = {id(b) for b in layer.buffers()}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._group = None

    # -- forward --

    def _worth_offloading(self, tensor: torch.Tensor) -> bool:
        # Parameters (also FSDP2's gathered ones) and buffers, or views of them, stay on the device anyway.
        base = tensor._base if tensor._base is not None else tensor
        return (
            type(tensor) is torch.Tensor
            and tensor.device == self.device
            and not isinstance(base, nn.Parameter)
            and id(base) not in self._buffers
            and tensor.numel() * tensor.element_size() >= self.min_bytes
        )

    def _pack(self, tensor: torch.Tensor) -> _Kept | tuple[_Offloaded, _ViewOf | None]:
        if not self._worth_offloading(tensor):
            return _Kept(tensor)
        # Views covering a whole tensor (a linear layer's 2-D view of its input, o_proj's of the attention output)
        # share one copy of that tensor; other views are copied on their own.
        base = tensor._base if tensor._base is not None else tensor
        source = base if base.numel() == tensor.numel() and _dense(base) else tensor
        view = None if source is tensor else _ViewOf(tensor, base)
        key = (id(source), source._version)
        saved = self._saved.get(key)
        if saved is None or saved.source_ref() is not source:
            saved = self._offload(source)
            self._saved[key] = saved
        return saved, view

    def _offload(self, source: torch.Tensor) -> _Offloaded:
        if self._group is None:
            self._group = self._start_group()
        host = torch.empty_like(source, device="cpu", pin_memory=self._pin)  # the same strides when dense
        saved = _Offloaded(source, group=self._group, host=host, copied=self._copy(source, into=host))
        self._group.saved.append(weakref.ref(saved))
        self.bytes_offloaded += source.numel() * source.element_size()
        return saved

    def _start_group(self) -> _Group:
        last = self._last_group
        if last is not None:
            older = last.previous() if last.previous is not None else None
            if older is not None:
                self._release(older, wait=True)
            self._release(last, wait=False)
        self._last_group = _Group(previous=last)
        return self._last_group

    def _release(self, group: _Group, *, wait: bool) -> None:
        """Let go of the device tensors of ``group`` whose copies are done, or of all of them with ``wait`` (the
        compute stream then waits for the copies before reusing their memory)."""
        for saved in group.live():
            if saved.source is None or (not wait and saved.copied is not None and not saved.copied.query()):
                continue
            if saved.copied is not None:
                torch.cuda.current_stream(self.device).wait_event(saved.copied)
            # Modified in place while the copy may have been reading it: refuse the copy, as autograd would.
            saved.modified = saved.source._version != saved.version
            saved.source = None

    # -- backward --

    def _unpack(self, packed: _Kept | tuple[_Offloaded, _ViewOf | None]) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.unpack()
        saved, view = packed
        tensor = self._get(saved)
        return tensor if view is None else view.of(tensor)

    def _get(self, saved: _Offloaded) -> torch.Tensor:
        group = saved.group
        if not group.backward_started:  # this layer's backward begins: bring the layer before it back meanwhile
            group.backward_started = True
            previous = group.previous() if group.previous is not None else None
            for other in previous.live() if previous is not None else []:
                self._restore(other)
        if saved.source is not None:  # still held: no round trip
            _check_version(saved.source, saved.version)
            return saved.source
        if saved.modified:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation "
                "before activation offloading knew its copy to host memory was done (the copy may hold either value)"
            )
        self._restore(saved)
        if saved.restored_event is not None:
            torch.cuda.current_stream(self.device).wait_event(saved.restored_event)
        return saved.restored

    def _restore(self, saved: _Offloaded) -> None:
        if saved.source is not None or saved.restored is not None:
            return
        # Allocated on the compute stream, which will use and free it; the side stream only fills it.
        saved.restored = torch.empty_like(saved.host, device=self.device)
        saved.restored_event = self._copy(saved.host, into=saved.restored)
        if saved.restored_event is not None:
            # Freed unused (a graph dropped before backward reached it): not reusable until the copy is done.
            saved.restored.record_stream(self._stream)
        self.bytes_restored += saved.host.numel() * saved.host.element_size()

    def _copy(self, source: torch.Tensor, *, into: torch.Tensor) -> torch.cuda.Event | None:
        """Copy ``source`` into ``into``: on CUDA on the side stream, after the work already queued on the compute
        stream (which produced ``source`` or last used ``into``'s memory), returning the event that marks it done;
        elsewhere synchronously (None)."""
        if self._stream is None:
            into.copy_(source)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            into.copy_(source, non_blocking=True)
            return self._stream.record_event()


def apply_activation_offloading(
    model: nn.Module, *, device: torch.device, min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
) -> ActivationOffloader | None:
    """Keep each decoder layer's activations in host memory between forward and backward (see
    :class:`ActivationOffloader`); returns the offloader, or None on a CPU, where activations already are in host
    memory and there is nothing to do (rank zero logs a notice).

    Apply to the plain model after activation checkpointing and ``compile_model``, before data parallelism.
    """
    if device.type == "cpu":
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning("activation_offloading: training runs on the CPU, whose memory is already the host's; ignored")
        return None
    offloader = ActivationOffloader(device=device, min_bytes=min_bytes)
    offloader.apply(model)
    return offloader
