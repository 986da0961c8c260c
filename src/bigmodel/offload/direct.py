"""Stream offloaded modules' weights from their files with direct reads into a few reused buffers.

While streaming (:class:`~bigmodel.offload.readahead.ReadAhead`: the offloaded bytes exceed what the page
cache can hold), each released module's file-backed values are read again at every forward (and the
kept ones until they are in the page cache).  Read
through the page cache (``MADV_WILLNEED``, page faults), every byte costs the kernel a fresh page: on
the 2-core development VM 1.3-1.5 s of system CPU time per GB, so reading 24 GB took 27-37 s with
both CPUs busy, where ``O_DIRECT`` reads of the same byte ranges into buffers allocated once took
13-23 s with 1-2 s of CPU time (BENCHMARKS.md, session 12).  Here a module's byte ranges are read
with ``O_DIRECT`` ``preadv`` calls (``CHUNK_BYTES`` each, ``READERS`` at once) into a :class:`Slot`
(anonymous memory, page-aligned, on transparent huge pages where the kernel has them, reused from module
to module and from forward to forward), and the
module's hook gets views of the slot in place of the mapped views.

The values are the same bytes at the same offsets modulo the page size (a tensor at file offset ``f``
lies at slot offset ``f mod 4096`` past a page boundary, as in the file's mapping; the runs read and the
values' places: :mod:`bigmodel.offload.layouts`), so kernels that
depend on alignment compute the same results.  A slot is read into again only when no tensor other
than the pool's own views it (the storage's use count, asked before reuse), so a module still
running, an output aliasing a weight, or a tensor saved for backward keeps its slot.  Nothing is
read this way where a value is not a plain contiguous tensor of a regular file's mapping, where the
file system refuses ``O_DIRECT`` (tmpfs), or where a page of the mapping was written in place
(``/proc/self/pagemap``, :func:`~bigmodel.offload.drop.written`): the mapped views are used then.
Linux only.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .drop import Mappings, written
from .file_spans import PAGE
from .layouts import (  # noqa: F401 (re-exported)
    _O_DIRECT,
    _USE_COUNT,
    GAP_BYTES,
    Layout,
    Run,
    layout,
    layout_possible,
)

logger = logging.getLogger(__name__)

CHUNK_BYTES = 128 << 20  # bytes per preadv call (the block layer splits it into max_sectors_kb requests)
READERS = 4  # preadv calls in flight: 4 x 128 MB read 2.5 GB/s here where 2 x 128 MB read 2.0-2.3 (session 12)


def _huge_pages(buffer: mmap.mmap) -> None:
    """Ask for transparent huge pages (``MADV_HUGEPAGE``; a hint: nothing changes where THP is off).

    A slot is read into with ``O_DIRECT`` at every forward and its values computed with: on 2 MB pages
    the kernel pins 512 times fewer pages per read, and the compute walks fewer page tables.  On the
    2-core VM a cold forward of the 2 GB fixture went from 1.19-1.31x max(cold read, in-memory forward)
    to 1.07-1.16x (``forward_cold_600mb``, BENCHMARKS.md, session 15)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buffer.madvise(advice)
        except OSError:  # a kernel built without THP
            pass


class Slot:
    """A page-aligned anonymous buffer of ``nbytes`` that module values are read into and viewed from."""

    def __init__(self, nbytes: int) -> None:
        # Private anonymous memory (mmap's default for -1 is shared, i.e. shmem): counted as the process's own.
        self.buffer = mmap.mmap(-1, max(nbytes, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _huge_pages(self.buffer)
        self.memory = memoryview(self.buffer)
        self.tensor = torch.frombuffer(self.buffer, dtype=torch.uint8)
        self._storage = self.tensor.untyped_storage()
        self._idle = _USE_COUNT(self._storage._cdata)  # type: ignore[misc]

    def free(self) -> bool:
        """True if no tensor but the slot's own views its memory (it may be read into)."""
        return _USE_COUNT(self._storage._cdata) == self._idle  # type: ignore[misc]

    def views(self, plan: Layout) -> dict[str, torch.Tensor]:
        """The values of ``plan`` as views of this slot (after its reads completed)."""
        out = dict(plan.others)
        for key, at, dtype, shape in plan.views:
            size = shape.numel() * dtype.itemsize
            out[key] = self.tensor[at:at + size].view(dtype).view(shape)
        return out


class Files:
    """``O_DIRECT`` descriptors of the files read, checked against the mapped file's inode."""

    def __init__(self) -> None:
        self._fds: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._fds)

    def fd(self, path: str, inode: int) -> int:
        """The descriptor (opened at the first call).  Raises OSError where the file is not that inode
        any more, or its file system refuses ``O_DIRECT``."""
        with self._lock:
            fd = self._fds.get((path, inode))
            if fd is None:
                fd = os.open(path, os.O_RDONLY | _O_DIRECT | getattr(os, "O_CLOEXEC", 0))
                if os.fstat(fd).st_ino != inode:
                    os.close(fd)
                    raise OSError(f"{path} was replaced since it was mapped")
                self._fds[(path, inode)] = fd
            return fd

    def close(self) -> None:
        with self._lock:
            _close_all(self._fds)


def _close_all(fds: dict[tuple[str, int], int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class Reading:
    """A module's reads in flight; :meth:`wait` gives its values (None where a read failed)."""

    def __init__(self, slot: Slot, plan: Layout, chunks: list[Future]) -> None:
        self.slot, self.plan, self.chunks = slot, plan, chunks

    def wait(self) -> dict[str, torch.Tensor] | None:
        try:
            for chunk in self.chunks:
                chunk.result()
        except (OSError, ValueError) as error:
            logger.debug("Direct read failed, the mapped values are used: %s", error)
            return None
        if any(value._version != version for value, version in self.plan.sources):
            return None  # changed in place since it was laid out: the mapped values are the current ones
        try:  # asked again once read: a file rewritten meanwhile had its mappings copied into memory first
            _check_unwritten(self.plan)
        except ValueError as error:
            logger.debug("%s since it was read: the mapped values are used", error)
            return None
        return self.slot.views(self.plan)


class Reader:
    """Reads layouts into slots on ``READERS`` threads, in the order asked."""

    def __init__(self) -> None:
        self.files = Files()
        self._pool: ThreadPoolExecutor | None = None

    def read(self, plan: Layout, slot: Slot) -> Reading:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READERS, thread_name_prefix="bigmodel-direct")
        first = self._pool.submit(_check_unwritten, plan)
        chunks = [first]
        for run in plan.runs:
            for start in range(0, run.length, CHUNK_BYTES):
                length = min(CHUNK_BYTES, run.length - start)
                chunks.append(self._pool.submit(self._chunk, run, start, length, slot, first))
        return Reading(slot, plan, chunks)

    def _chunk(self, run: Run, start: int, length: int, slot: Slot, checked: Future) -> None:
        """Read ``length`` bytes of ``run`` from ``start`` into ``slot``.  Raises OSError where the file
        ends before the values do (truncated since it was mapped): the slot would hold stale bytes."""
        checked.result()
        fd = self.files.fd(run.path, run.inode)
        needed = min(length, run.data - start)  # past the values, the file may end (the last page is rounded up)
        done, at = 0, run.at + start
        while done < needed:
            got = os.preadv(fd, [slot.memory[at + done:at + length]], run.offset + start + done)
            if got <= 0:
                raise OSError(f"{run.path} ends {needed - done} bytes before its values do (truncated?)")
            done += got

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.files.close()


def _check_unwritten(plan: Layout) -> None:
    for address, length in plan.spans:
        if written(address, length):
            raise ValueError("a page of the mapping was written in place")


class Streams:
    """The direct reads of one :class:`~bigmodel.offload.readahead.ReadAhead`: a layout per order position,
    ``count`` slots of the largest layout's bytes, and the reading or taken slot of each module (by key,
    ``id`` of its hook).  Every method may be called from any forward thread.

    Args:
        fraction: slots are only made when ``count`` of them take at most this fraction of the
            available memory (anonymous memory: the kernel cannot reclaim it as it does page cache).
    """

    def __init__(self, fraction: float = 0.25) -> None:
        self.fraction = fraction
        self.reader = Reader()
        self.layouts: list[Layout | None] = []
        self._size = 0
        self._count = 0
        self._slots: list[Slot] = []
        self._idle: list[tuple[Slot, list[Future]]] = []  # with the reads that may still write into it
        self._reading: dict[int, Reading] = {}
        self._held: dict[int, Slot] = {}
        self._lock = threading.Lock()

    def plan(self, values: list[dict[str, torch.Tensor]], count: int, available: int) -> bool:
        """Lay out each position's ``values``; True if ``count`` slots fit (else nothing is read directly).

        Slots of the last plan are kept where they are large enough (the first forward's order is a
        guess, replaced at the second: new slots would cost their memory's first touch again)."""
        self.reset()
        mappings = Mappings()  # read now: the values are mapped already
        layouts = [layout(v, mappings) if v else None for v in values]
        size = max((plan.nbytes for plan in layouts if plan is not None), default=0)
        fits = bool(size) and count * size <= self.fraction * available
        with self._lock:
            if not fits or size > self._size:
                self._slots, self._idle, self._size = [], [], 0
            if fits:
                self.layouts, self._size, self._count = layouts, max(size, self._size), count
        return fits

    def read(self, position: int, key: int) -> bool:
        """Start reading position ``position``'s module (hook ``key``) into a slot; False when it has no
        layout or no slot is free (its mapped views are used)."""
        plan = self.layouts[position] if position < len(self.layouts) else None
        if plan is None or not key:
            return False
        with self._lock:
            if key in self._reading:
                return True  # read ahead already (the end of the last pass read on into this one)
            self._give_back(key)
            slot = self._acquire()
            if slot is None:
                return False
            self._reading[key] = self.reader.read(plan, slot)
        return True

    def serves(self, key: int) -> bool:
        """True if module ``key``'s values are being read into a slot (nothing else need read them)."""
        return key in self._reading

    def take(self, key: int) -> dict[str, torch.Tensor] | None:
        """Module ``key``'s values, once read (waits), or None (not read here, or the read failed)."""
        with self._lock:
            reading = self._reading.pop(key, None)
        if reading is None:
            return None
        try:
            values = reading.wait()
        except BaseException:  # KeyboardInterrupt while waiting (the forward mostly waits for the disk here)
            with self._lock:
                self._idle_again(reading.slot, reading.chunks)  # popped above: else the slot is lost for good
            raise
        with self._lock:
            if values is None:
                self._idle_again(reading.slot)
                return None
            held = self._held.pop(key, None)  # another forward's take of this module (threads) kept its slot
            if held is not None:
                self._idle_again(held)
            self._held[key] = reading.slot
        return values

    def release(self, key: int) -> bool:
        """Module ``key`` has run: its slot may be read into again (once no tensor views it).  True if it
        ran on a slot's views (its mapped views' pages were then never read); False where a reading was
        never taken (recording gradients, the hook used its mapped views: their pages are to be released)."""
        with self._lock:
            return self._give_back(key)

    def give_back_except(self, keys: set[int]) -> None:
        """A new pass starts: every module's slot may be read into again (once no tensor views it) but those of
        ``keys``, read ahead for it already.  The last pass's last module holds its slot until now, and a pass
        that raised midway left its running module's slot held and its reads ahead unused."""
        with self._lock:
            for key in [key for key in (*self._reading, *self._held) if key not in keys]:
                self._give_back(key)

    def reset(self) -> None:
        """Forget the layouts and what each module was read into (the slots stay for the next plan)."""
        with self._lock:
            self.layouts = []
            for key in list(self._reading) + list(self._held):
                self._give_back(key)

    def close(self) -> None:
        """Forget everything: the slots' memory is freed once no tensor views it."""
        self.reset()
        with self._lock:
            self._slots, self._idle, self._size, self._count = [], [], 0, 0
        self.reader.close()

    def _give_back(self, key: int) -> bool:
        reading = self._reading.pop(key, None)
        slot = self._held.pop(key, None)
        if reading is not None:
            self._idle_again(reading.slot, reading.chunks)
        if slot is not None:
            self._idle_again(slot)
        return slot is not None

    def _idle_again(self, slot: Slot, chunks: list[Future] | None = None) -> None:
        """``slot`` may be read into again (once ``chunks`` are done), unless a new plan dropped it since it
        was taken (another forward's module held it meanwhile: it may be smaller than the new layouts)."""
        if any(slot is mine for mine in self._slots):
            self._idle.append((slot, chunks or []))

    def _acquire(self) -> Slot | None:
        for i, (slot, chunks) in enumerate(self._idle):
            if all(chunk.done() for chunk in chunks) and slot.free():
                del self._idle[i]
                return slot
        if len(self._slots) < self._count:
            slot = Slot(self._size)
            self._slots.append(slot)
            return slot
        for i, (slot, chunks) in enumerate(self._idle):  # a read given up (a reset) may still be writing into it
            if slot.free():
                del self._idle[i]
                for chunk in chunks:
                    chunk.exception()  # waits; its outcome no longer matters
                return slot
        return None
