"""A bounded staging ring (pinned when an accelerator exists) for weights read from disk.

:class:`StagingBuffer` is one buffer of a fixed size (bytes) that disk-resident weights are read
into, on a reader thread, just before they are copied to the device; its memory is reused as a
ring, never allocated per step.  If the buffer cannot be pinned, it falls back to ordinary
memory (``pin_failed`` says so, and callers then copy pageable values directly).  Pinning
itself is :mod:`bigmodel.transfer.pinned`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.sizes import convert_file_size_to_int
from . import pinned as _pinned
from .pinned import (
    ALIGNMENT,
    PIN_MEMORY_ENV,
    _align,
    _byte_view,
    _nbytes,
    _same_tensor_key,
    pin_memory_enabled,
)

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class StagedBatch:
    """Tensors read into a region of a :class:`StagingBuffer`; give the region back with :meth:`release`.

    Attributes:
        tensors: name → view into the staging buffer (same dtype and shape as the source).
        start: first byte of the region in the buffer.
        end: one past the last byte of the region.
    """

    tensors: dict[str, torch.Tensor]
    start: int
    end: int
    _owner: StagingBuffer = field(repr=False)
    _released: bool = field(default=False, repr=False)
    _fence: Any = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes of the buffer this batch holds (aligned)."""
        return self.end - self.start

    def release(self, after: Any = None) -> None:
        """Give the region back; with ``after``, only once that copy has read it.

        Args:
            after: the copy that reads these tensors: a :class:`bigmodel.transfer.copies.PendingCopy`
                (its ``event`` is used) or a :class:`torch.Event`.  The region is reused only when
                it has completed; the wait happens on the thread that needs the space, never on
                the device as a whole.  None: the region is free at once (the caller is done).

        Raises:
            RuntimeError: if the batch was already released.
        """
        self._owner._release(self, getattr(after, "event", after))


class StagingBuffer:
    """A bounded staging buffer (pinned when an accelerator exists) for weights read from disk.

    A reader thread calls :meth:`stage` to copy a module's weights (mmap views of a safetensors
    file or an offload folder) into the buffer, the main thread copies the staged views to the
    device and releases the batch with ``after=`` that copy.  The buffer is allocated once and
    used as a ring: regions are handed out in order and come back when released, so reads ahead
    are bounded by ``capacity`` bytes.  :meth:`stage` blocks (on the calling thread only) until
    enough space is free.  Thread-safe.

    Do not stage weights for a ``cpu`` execution device: a copy to the CPU returns the staged
    views themselves, which the next read would overwrite; use the weights in place there.
    """

    def __init__(self, capacity: int | str, *, pin: bool = True, alignment: int = ALIGNMENT) -> None:
        """Allocate the buffer.

        Args:
            capacity: size in bytes (or a string such as ``"2GiB"``).  Powers of two waste nothing
                where the host allocator rounds up.
            pin: page-lock the buffer (ignored without an accelerator or with ``BIGMODEL_PIN_MEMORY=0``).
            alignment: byte multiple of every tensor's offset.

        Raises:
            ValueError: if ``capacity`` or ``alignment`` is not a positive size.
        """
        self.capacity = convert_file_size_to_int(capacity)
        if self.capacity <= 0 or alignment <= 0:
            raise ValueError(
                f"StagingBuffer needs a positive capacity and alignment (got {capacity!r} and {alignment}); "
                "give the bytes to read ahead, e.g. '1GiB'."
            )
        self.alignment = alignment
        self.pinned = pin_memory_enabled(pin)
        self.pin_failed = False  # pinning was asked for and refused: the buffer is ordinary memory
        self.buffer = self._allocate()
        self._live: deque[StagedBatch] = deque()
        self._cond = threading.Condition()

    def _allocate(self) -> torch.Tensor:
        if self.pinned:
            try:
                return _pinned._pinned_arena(self.capacity)
            except RuntimeError as error:  # page-locking can fail when the OS limits locked memory
                logger.warning(
                    "Could not pin a %d-byte staging buffer (%s); disk weights are copied from pageable "
                    "memory, which is slower. Set %s=0 to skip pinning on this machine.",
                    self.capacity, error, PIN_MEMORY_ENV,
                )
                self.pinned, self.pin_failed = False, True
        with torch.inference_mode(False):  # reused across forwards: never an inference tensor
            return torch.empty(self.capacity, dtype=torch.uint8)

    def close(self) -> None:
        """Wait for the copies still reading the buffer, then drop it (its memory is freed).

        Call :func:`bigmodel.transfer.pinned.empty_host_cache` afterwards to give pinned memory
        back to the OS.  The buffer cannot stage anything afterwards.
        """
        with self._cond:
            for batch in self._live:
                if batch._released and batch._fence is not None:
                    batch._fence.synchronize()
            self._live.clear()
            self.buffer = torch.empty(0, dtype=torch.uint8)
            self.capacity = 0

    @property
    def used(self) -> int:
        """Bytes held by batches not yet reclaimed (released batches count until reclaimed)."""
        with self._cond:
            return sum(batch.nbytes for batch in self._live)

    def stage(self, tensors: Mapping[str, torch.Tensor], timeout: float | None = None) -> StagedBatch:
        """Copy ``tensors`` into one free region of the buffer.

        Args:
            tensors: name → CPU tensor (any dtype; copied bit for bit, never cast).  Tied tensors
                are staged once.
            timeout: seconds to wait for free space; None waits until another thread releases.

        Returns:
            The staged batch; its ``tensors`` are contiguous views into the buffer.

        Raises:
            ValueError: if the tensors need more than ``capacity`` bytes, or one is not on the CPU.
            TimeoutError: if no space freed up within ``timeout`` seconds.
        """
        unique: dict[tuple, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"Cannot stage {name!r}: it is on {tensor.device}, not the CPU; copy device tensors "
                    "directly with CopyStream.copy."
                )
            unique.setdefault(_same_tensor_key(tensor), tensor)
        offsets, total = {}, 0
        for key, tensor in unique.items():
            offsets[key] = total
            total += _align(_nbytes(tensor), self.alignment)
        if total > self.capacity:
            raise ValueError(
                f"Staging {len(unique)} tensors ({', '.join(map(repr, list(tensors)[:3]))}) needs {total} bytes, "
                f"more than the staging buffer's {self.capacity}; create the StagingBuffer with a capacity "
                "of at least the largest offloaded module's size."
            )
        batch = self._reserve(total, timeout)
        views = {}
        try:
            for key, tensor in unique.items():
                views[key] = _byte_view(self.buffer, batch.start + offsets[key], tensor)
                views[key].copy_(tensor)  # the disk read, for memory-mapped sources
        except BaseException:
            batch.release()  # a failed read must not leave its region reserved forever
            raise
        batch.tensors = {name: views[_same_tensor_key(tensor)] for name, tensor in tensors.items()}
        return batch

    def _place(self, nbytes: int) -> int | None:
        """Offset of a free contiguous region of ``nbytes`` after the newest batch, or None."""
        if not self._live:
            return 0
        first, last = self._live[0].start, self._live[-1]
        if last.start >= first:  # not wrapped: free space is after the newest and before the oldest
            if last.end + nbytes <= self.capacity:
                return last.end
            return 0 if nbytes <= first else None
        return last.end if last.end + nbytes <= first else None

    def _reclaim(self) -> bool:
        """Drop released batches from the front whose copies are done; True if any was dropped."""
        dropped = False
        while self._live and self._live[0]._released:
            fence = self._live[0]._fence
            if fence is not None and not fence.query():
                break
            self._live.popleft()
            dropped = True
        return dropped

    def _reserve(self, nbytes: int, timeout: float | None) -> StagedBatch:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._reclaim()
                start = self._place(nbytes)
                if start is not None:
                    batch = StagedBatch({}, start, start + nbytes, self)
                    self._live.append(batch)
                    return batch
                fence = self._live[0]._fence if self._live[0]._released else None
                if fence is not None:  # this thread waits for one copy, never for the whole device
                    self._cond.release()
                    try:
                        fence.synchronize()
                    finally:
                        self._cond.acquire()
                    continue
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not self._cond.wait(left) and left is not None:
                    raise TimeoutError(
                        f"No {nbytes} free bytes in the staging buffer ({self.capacity} bytes, "
                        f"{len(self._live)} batches unreleased) after {timeout} s; release staged batches "
                        "once copied (StagedBatch.release) or use a larger capacity."
                    )

    def _release(self, batch: StagedBatch, fence: Any) -> None:
        with self._cond:
            if batch._released or batch._owner is not self:
                raise RuntimeError(
                    f"Staged batch at bytes {batch.start}..{batch.end} was already released; release each "
                    "batch exactly once, after its copy has been issued."
                )
            batch._released, batch._fence = True, fence
            self._reclaim()
            self._cond.notify_all()
