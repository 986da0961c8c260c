"""Pinned host memory: page-locked copies of CPU weights, and a bounded pinned staging buffer.

- :func:`pin_tensors` — page-locked copies of CPU-resident weights, so host→device copies run
  asynchronously at full bus speed.  Opt out with ``enabled=False`` or ``BIGMODEL_PIN_MEMORY=0``
  (pinning holds a second copy of the weights while the caller keeps the originals).
- :class:`StagingBuffer` — one pinned buffer of a fixed size (bytes) that disk-resident weights
  are read into, on a reader thread, just before they are copied to the device; its memory is
  reused as a ring, never allocated per step.

Whether memory is pinned depends on :func:`bigmodel.core.devices.accelerator_type` only (no backend
named here).  On a machine without an accelerator pinning is the identity and the staging
buffer uses ordinary memory.  Nothing here casts: tensors keep their storage dtype.
The copies themselves (side streams, events) are in :mod:`bigmodel.transfer.copies`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.devices import accelerator_type
from ..core.sizes import convert_file_size_to_int

logger = logging.getLogger(__name__)

PIN_MEMORY_ENV = "BIGMODEL_PIN_MEMORY"
# Host allocators (CUDA's among them) round every pinned allocation up to a power of two, so
# many tensors are packed into shared arenas of at least this size (bytes, a power of two).
PINNED_ARENA_BYTES = 256 * 2**20
# Offsets inside pinned arenas and the staging buffer are multiples of this (bytes): every
# dtype view is aligned and copies start on DMA-friendly boundaries.
ALIGNMENT = 512

_FALSE = ("0", "false", "no", "off")
_TRUE = ("", "1", "true", "yes", "on")


def _align(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return -(-nbytes // alignment) * alignment


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _same_tensor_key(tensor: torch.Tensor) -> tuple:
    """Identity of a tensor's data: tied tensors (same storage, offset, shape, strides) share it."""
    storage = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


# ----------------------------------------------------------------------------- pinned memory


def pin_memory_enabled(enabled: bool = True) -> bool:
    """Whether host memory should be pinned: asked for, allowed by the environment, accelerator present.

    Args:
        enabled: the caller's choice; False always wins.

    Returns:
        True when ``enabled``, ``BIGMODEL_PIN_MEMORY`` is unset or true, and torch sees an accelerator.

    Raises:
        ValueError: if ``BIGMODEL_PIN_MEMORY`` holds something other than 0/1/true/false/yes/no/on/off.
    """
    value = os.environ.get(PIN_MEMORY_ENV, "1").strip().lower()
    if value not in _FALSE + _TRUE:
        raise ValueError(
            f"{PIN_MEMORY_ENV}={os.environ[PIN_MEMORY_ENV]!r} is not a switch; set it to 0 to turn "
            "pinned host memory off (RAM-tight machines) or 1 to allow it."
        )
    return bool(enabled) and value not in _FALSE and accelerator_type() is not None


def _pinned_arena(nbytes: int) -> torch.Tensor:
    with torch.inference_mode(False):  # kept across forwards: never an inference tensor
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _byte_view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``buffer[offset:]`` with ``like``'s dtype and shape (contiguous)."""
    return buffer[offset : offset + _nbytes(like)].view(like.dtype).view(like.shape)


def _plan_arenas(sizes: list[int], arena_bytes: int) -> tuple[list[int], list[tuple[int, int]]]:
    """First-fit packing of byte sizes into power-of-two arenas: (arena sizes, (arena, offset) per size)."""
    arenas: list[list[int]] = []  # [capacity, used]
    places: list[tuple[int, int]] = []
    for size in sizes:
        need = _align(size)
        for index, (capacity, used) in enumerate(arenas):
            if used + need <= capacity:
                places.append((index, used))
                arenas[index][1] += need
                break
        else:
            capacity = max(arena_bytes, 1 << max(need - 1, 0).bit_length())
            arenas.append([capacity, need])
            places.append((len(arenas) - 1, 0))
    # The allocator rounds to a power of two anyway; shrink each arena to what it really holds.
    return [1 << max(used - 1, 0).bit_length() for _, used in arenas], places


def pin_tensors(tensors: Mapping[str, torch.Tensor], enabled: bool = True) -> dict[str, torch.Tensor]:
    """Page-locked copies of CPU tensors, for asynchronous host→device copies.

    Call it once with all CPU-resident weights of a model rather than per module: the tensors
    are packed into shared pinned arenas (powers of two, at least ``PINNED_ARENA_BYTES``)
    because host allocators round each pinned allocation up to a power of two, which would
    otherwise waste up to half of the pinned RAM.  Tied tensors are pinned once and stay shared.
    Tensors already pinned, or not on the CPU, are returned as they are.  The copies are
    contiguous plain tensors of the same dtype and shape (never cast).

    Args:
        tensors: name → tensor.
        enabled: False returns the tensors unchanged (so does ``BIGMODEL_PIN_MEMORY=0`` and a
            machine without an accelerator).

    Returns:
        A new dict name → tensor (the same objects when pinning is off).

    Raises:
        ValueError: if ``BIGMODEL_PIN_MEMORY`` is not a switch.
    """
    if not pin_memory_enabled(enabled):
        return dict(tensors)
    todo: dict[tuple, list[str]] = {}
    first: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.is_pinned() or tensor.numel() == 0:
            out[name] = tensor
            continue
        key = _same_tensor_key(tensor)
        todo.setdefault(key, []).append(name)
        first.setdefault(key, tensor)
    keys = list(todo)
    sizes, places = _plan_arenas([_nbytes(first[k]) for k in keys], PINNED_ARENA_BYTES)
    try:
        arenas = [_pinned_arena(size) for size in sizes]
    except RuntimeError as error:  # page-locking can fail when the OS limits locked memory
        logger.warning(
            "Could not pin %d bytes of host memory (%s); copies stay pageable and slower. "
            "Set %s=0 to skip pinning on this machine.", sum(sizes), error, PIN_MEMORY_ENV,
        )
        return dict(tensors)
    for key, (arena, offset) in zip(keys, places):
        pinned = _byte_view(arenas[arena], offset, first[key])
        pinned.copy_(first[key])
        for name in todo[key]:
            out[name] = pinned
    logger.debug("Pinned %d tensors into %d arenas (%d bytes).", len(keys), len(arenas), sum(sizes))
    return {name: out[name] for name in tensors}


# ----------------------------------------------------------------------------- staging buffer


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
        with torch.inference_mode(False):  # reused across forwards: never an inference tensor
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=self.pinned)
        self._live: deque[StagedBatch] = deque()
        self._cond = threading.Condition()

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
