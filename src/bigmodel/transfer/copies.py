"""Host→device copies on a side stream, ordered by events, and the prefetcher's device stager.

- :class:`CopyStream` — copies on a side stream, ordered by an event: the consumer's stream
  waits on that event (``PendingCopy.wait``), the host never waits on the whole device.
- :class:`DeviceStager` — the prefetcher's staging function for an accelerator: pinned values
  are copied directly, pageable ones (memory-mapped disk weights) go through a bounded pinned
  :class:`~bigmodel.transfer.pinned.StagingBuffer` first.

Everything goes through :mod:`torch.accelerator`, :class:`torch.Stream` and
:class:`torch.Event`; the backend is :func:`bigmodel.core.devices.accelerator_type`.  On a machine
without an accelerator (or for a ``cpu`` target) the same interface runs synchronously with no
stream.  Pinned memory itself is :mod:`bigmodel.transfer.pinned`.

Tensors cross the bus in their storage dtype: nothing here casts (fp8 and bf16 stay fp8 and
bf16; a layerwise-casting hook upcasts on the device, after the copy).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch

from ..core.devices import DeviceSpec, accelerator_type, torch_device
from ..core.sizes import convert_file_size_to_int
from .pinned import StagingBuffer, _align, _nbytes, _same_tensor_key, pin_memory_enabled

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- side-stream copies


def _uses_stream(device: torch.device) -> bool:
    """True when copies to ``device`` run on a side stream (the device is the current accelerator type)."""
    return device.type == accelerator_type()


def _new_stream(device: torch.device) -> torch.Stream:
    return torch.Stream(device=device)


def _current_stream(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def _new_event(device: torch.device) -> torch.Event:
    return torch.Event(device=device)


def _is_device_source(tensor: torch.Tensor, target: torch.device) -> bool:
    """True for a source on the target's device type (written by device work, unlike host memory)."""
    return tensor.device.type == target.type


def _record_stream(tensor: torch.Tensor, stream: torch.Stream) -> bool:
    """Tell the device allocator ``stream`` uses ``tensor``; False where the backend cannot."""
    try:
        tensor.record_stream(stream)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class PendingCopy:
    """The result of :meth:`CopyStream.copy`: tensors that are valid on the device once waited for.

    Attributes:
        event: recorded on the copy stream after the copies (None for a synchronous copy).
        device: the target device.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], device: torch.device,
                 event: torch.Event | None = None, owner: CopyStream | None = None) -> None:
        self._tensors = tensors
        self.device = device
        self.event = event
        self._owner = owner

    def ready(self) -> bool:
        """True when the copies have finished (never blocks)."""
        return self.event is None or self.event.query()

    def wait(self) -> dict[str, torch.Tensor]:
        """Make the current stream of the target device wait for the copies, and return the tensors.

        The host does not block: only work queued afterwards on the current stream is ordered after
        the copies.  The tensors are marked as used by that stream, so their device memory is not
        reused by a later copy before the consumer's work on them is done.

        Returns:
            name → tensor on the target device, in the source's dtype.
        """
        if self.event is not None:
            consumer = _current_stream(self.device)
            consumer.wait_event(self.event)
            seen = set()
            for tensor in self._tensors.values():
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    if not _record_stream(tensor, consumer) and self._owner is not None:
                        self._owner._fence_consumer = True
        return dict(self._tensors)

    def synchronize(self) -> None:
        """Block the calling host thread until these copies are done (not the whole device)."""
        if self.event is not None:
            self.event.synchronize()


class CopyStream:
    """Copies tensors to one device on a side stream, so transfers overlap compute.

    On an accelerator each :meth:`copy` is queued on a dedicated stream and followed by an event;
    the consumer calls :meth:`PendingCopy.wait` on its own stream before using the tensors.  For a
    ``cpu`` (or ``meta``) device, and on machines without an accelerator, :meth:`copy` is a plain
    synchronous ``.to(device)`` behind the same interface (no copy when already there).

    Source tensors should be pinned (:func:`pin_tensors`, :class:`StagingBuffer`) for the copy to be
    asynchronous; pageable sources still work, the host then waits while the driver stages them.
    """

    def __init__(self, device: DeviceSpec) -> None:
        """Create the side stream for ``device``.

        Args:
            device: the target device (an accelerator index, ``"cuda:0"``, a torch.device, ``"cpu"``).

        Raises:
            ValueError: for ``"disk"`` or an accelerator index on a machine without an accelerator.
        """
        self.device = torch_device(device)
        if self.device.type not in ("cpu", "meta") and self.device.index is None:
            self.device = torch.device(self.device.type, torch.accelerator.current_device_index())
        self.stream = _new_stream(self.device) if _uses_stream(self.device) else None
        # Set when the backend cannot record_stream: later copies then wait for the consumer first.
        self._fence_consumer = False

    def _target(self, device: DeviceSpec | None) -> torch.device:
        if device is None:
            return self.device
        target = torch_device(device)
        if target.type == self.device.type and target.index is None:
            return self.device
        if self.stream is not None and target.type == self.device.type and target != self.device:
            raise ValueError(
                f"This CopyStream copies to {self.device}, not {target}; create one CopyStream per device."
            )
        return target

    def copy(self, tensors: Mapping[str, torch.Tensor], device: DeviceSpec | None = None,
             non_blocking: bool = True) -> PendingCopy:
        """Copy ``tensors`` to ``device`` (default: this stream's device), keeping each dtype.

        Args:
            tensors: name → tensor (tied tensors are copied once and stay shared).
            device: the target; must be this stream's device when it is an accelerator.
            non_blocking: False makes the host wait for these copies before returning.

        Returns:
            A :class:`PendingCopy`; call ``wait()`` on the consuming stream to get the tensors.

        Raises:
            ValueError: if a tensor is on ``meta`` (it has no data), or the target is another
                accelerator than this stream's.
        """
        target = self._target(device)
        sources: dict[tuple, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if tensor.device.type == "meta" and target.type != "meta":
                raise ValueError(
                    f"Cannot copy {name!r}: it is on the meta device and has no data; read its value "
                    "from the weights map (offload folder or state dict) and copy that."
                )
            sources.setdefault(_same_tensor_key(tensor), tensor)
        if self.stream is None or target != self.device:
            copied = {key: t.to(target, non_blocking=non_blocking and target.type != "cpu")
                      for key, t in sources.items()}
            return PendingCopy(self._by_name(tensors, copied), target)
        copied, event = self._copy_on_stream(sources, target, non_blocking)
        return PendingCopy(self._by_name(tensors, copied), target, event, self)

    @staticmethod
    def _by_name(tensors: Mapping[str, torch.Tensor], copied: dict[tuple, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name: copied[_same_tensor_key(tensor)] for name, tensor in tensors.items()}

    def _copy_on_stream(self, sources: dict[tuple, torch.Tensor], target: torch.device,
                        non_blocking: bool) -> tuple[dict[tuple, torch.Tensor], torch.Event]:
        consumer = _current_stream(target)
        if self._fence_consumer or any(_is_device_source(t, target) for t in sources.values()):
            # Device sources may still be written by the consumer; without record_stream, memory the
            # consumer freed may still be read by it.  Either way: start after its queued work.
            self.stream.wait_stream(consumer)
        with self.stream:
            copied = {key: t.to(target, non_blocking=True) for key, t in sources.items()}
            event = _new_event(target)
            event.record(self.stream)
        if not non_blocking:
            event.synchronize()
        return copied, event


# ----------------------------------------------------------------------------- prefetch staging


STAGING_ENV = "BIGMODEL_STAGING_BYTES"
DEFAULT_STAGING_BYTES = 256 * 2**20


class DeviceStager:
    """The prefetcher's staging function for accelerators: ``stager(values, device) -> PendingCopy``.

    Pinned values (see :func:`pin_tensors`) are copied straight to the device on a side stream.
    Pageable values (memory-mapped weights from disk, unpinned RAM) are first read into a bounded
    pinned :class:`StagingBuffer` on the calling (prefetch) thread, then copied; their staging
    region is reused as soon as that copy is done.  For a CPU device the values are returned as
    they are.  Call it from the prefetch thread; call ``wait()`` on the result from the thread
    that runs the forward.
    """

    def __init__(self, staging_bytes: int | str | None = None, *, pin: bool = True) -> None:
        """Args:
            staging_bytes: initial staging buffer size in bytes (default ``$BIGMODEL_STAGING_BYTES``
                or 256 MiB); it grows to twice a module's pageable bytes when a module needs more.
            pin: False (or ``BIGMODEL_PIN_MEMORY=0``) copies pageable values directly, without staging.
        """
        default = os.environ.get(STAGING_ENV) or DEFAULT_STAGING_BYTES
        self.staging_bytes = convert_file_size_to_int(staging_bytes if staging_bytes is not None else default)
        self.pin = pin
        self._streams: dict[torch.device, CopyStream] = {}
        self._staging: StagingBuffer | None = None
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> DeviceStager:
        """A new stager with the same settings (its own streams and staging buffer, made when first used)."""
        return DeviceStager(self.staging_bytes, pin=self.pin)

    def _buffer(self, nbytes: int) -> StagingBuffer:
        with self._lock:
            if self._staging is None or self._staging.capacity < nbytes:
                capacity = max(self.staging_bytes, 1 << (2 * nbytes - 1).bit_length())
                logger.debug("Staging buffer of %d bytes for reads ahead from disk.", capacity)
                self._staging = StagingBuffer(capacity)  # in-flight copies keep the old one alive
            return self._staging

    def _stream(self, device: torch.device) -> CopyStream:
        with self._lock:
            if device not in self._streams:
                self._streams[device] = CopyStream(device)
            return self._streams[device]

    def __call__(self, values: Mapping[str, torch.Tensor], device: torch.device | None) -> Any:
        """Start copying ``values`` to ``device``.

        Returns:
            A :class:`PendingCopy` (accelerator) or the values unchanged (CPU or no device).
        """
        if device is None or not _uses_stream(device):
            return dict(values)
        stream = self._stream(device)
        pageable = {n: t for n, t in values.items() if t.device.type == "cpu" and not t.is_pinned()}
        if not pageable or not pin_memory_enabled(self.pin):
            return stream.copy(values, device)
        batch = self._buffer(sum(_align(_nbytes(t)) for t in pageable.values())).stage(pageable)
        pending = stream.copy({name: batch.tensors.get(name, t) for name, t in values.items()}, device)
        batch.release(after=pending)
        return pending
