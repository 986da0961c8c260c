"""Cold-cache helpers: drop chosen byte ranges of chosen files from the page cache, read them cold.

Never a global drop (``/proc/sys/vm/drop_caches``): only the ranges given, of the files given.
A page the measuring process itself has mapped (an mmap view of a checkpoint) is not dropped by
``posix_fadvise(DONTNEED)`` while it is mapped, so the mapped pages of those ranges are first
unmapped from this process's page tables with ``madvise(MADV_DONTNEED)`` (the mappings stay;
the next access reads the file again; safe because benchmark weights are never written).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4
CHUNK = 8 << 20

_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)

Ranges = Mapping[str, list[tuple[int, int]]]  # file path -> [(start, end)) byte ranges


def _mappings_of(paths: set[str]) -> list[tuple[int, int, int, str]]:
    """(address start, address end, file offset, path) of this process's mappings of ``paths``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() in paths:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi, int(parts[2], 16), parts[5].strip()))
    return out


def _page_span(start: int, end: int) -> tuple[int, int]:
    return start // PAGE * PAGE, -(-end // PAGE) * PAGE


def _inner_span(start: int, end: int, size: int) -> tuple[int, int]:
    """The pages wholly inside ``[start, end)`` of a file of ``size`` bytes (its last page counts whole at its end):
    a page shared with bytes outside the range (another module's tensor) stays cached."""
    return -(-start // PAGE) * PAGE, -(-end // PAGE) * PAGE if end >= size else end // PAGE * PAGE


def drop(ranges: Ranges) -> None:
    """Drop the byte ranges of each file from the page cache (unmapping this process's pages first).  Only the
    pages wholly inside a range: one it shares with other bytes (a tensor of a module in memory) is kept."""
    paths = {str(Path(p).resolve()) for p in ranges}
    resolved = {str(Path(p).resolve()): r for p, r in ranges.items()}
    sizes = {path: os.path.getsize(path) for path in resolved}
    for lo, hi, offset, path in _mappings_of(paths):
        for start, end in resolved[path]:
            a, b = _inner_span(max(start, offset), min(end, offset + hi - lo), sizes[path])
            if a < b:
                _LIBC.madvise(ctypes.c_void_p(lo + a - offset), b - a, MADV_DONTNEED)
    for path, spans in resolved.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, end in spans:
                a, b = _inner_span(start, end, sizes[path])
                if a < b:
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(ranges: Ranges) -> float:
    """Fraction of the pages of the ranges that are in the page cache now (``mincore`` of a fresh mapping)."""
    cached = total = 0
    for path, spans in ranges.items():
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = np.frombuffer(mm, dtype=np.uint8)
        base = int(view.ctypes.data)
        for start, end in spans:
            a, b = _page_span(start, min(end, size))
            pages = (b - a) // PAGE
            vec = ctypes.create_string_buffer(pages)
            if _LIBC.mincore(ctypes.c_void_p(base + a), b - a, vec) == 0:
                cached += sum(byte & 1 for byte in vec.raw)
                total += pages
        del view
        mm.close()
    return cached / total if total else 0.0


def read_cold(ranges: Ranges) -> tuple[float, int]:
    """Drop the ranges, then read them sequentially (8 MiB ``preadv`` calls). Returns (seconds, bytes)."""
    drop(ranges)
    buf = bytearray(CHUNK)
    total = 0
    t0 = time.perf_counter()
    for path, spans in ranges.items():
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, end in sorted(spans):
                pos = start
                while pos < end:
                    n = os.preadv(fd, [memoryview(buf)[: min(CHUNK, end - pos)]], pos)
                    if n <= 0:
                        break
                    pos += n
                    total += n
        finally:
            os.close(fd)
    seconds = time.perf_counter() - t0
    drop(ranges)
    return seconds, total


def read_direct(ranges: Ranges, chunk: int = 128 << 20, threads: int = 4) -> tuple[float, int]:
    """Read the ranges (widened to whole pages) with ``O_DIRECT``, ``threads`` ``chunk``-byte ``preadv`` calls
    in flight, into buffers allocated (and touched) before the clock starts: the storage's own rate, without
    the page cache's CPU time per byte. Returns (seconds, bytes of the ranges)."""
    return DirectReader(chunk, threads).read(ranges)


class DirectReader:
    """:func:`read_direct` with its buffers made once (touched: the clock measures the storage, not first
    touches) and its threads kept, for repeated cold reads (one beside a forward, too)."""

    def __init__(self, chunk: int = 128 << 20, threads: int = 4) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.chunk = chunk
        self.buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
        for buffer in self.buffers:
            buffer.write(b"\1" * chunk)
        self.pool = ThreadPoolExecutor(threads)

    def read(self, ranges: Ranges) -> tuple[float, int]:
        """Drop nothing; read the ranges as they are (drop them first for a cold read). Returns (seconds, bytes)."""
        jobs = []
        for path, spans in ranges.items():
            for start, end in merge(sorted(spans)):
                lo, hi = start - start % PAGE, -(-end // PAGE) * PAGE
                jobs += [(path, pos, min(self.chunk, hi - pos)) for pos in range(lo, hi, self.chunk)]
        fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in ranges}
        free = list(self.buffers)
        lock = threading.Lock()

        def one(job: tuple[str, int, int]) -> None:
            path, pos, length = job
            with lock:
                buffer = free.pop()
            try:
                os.preadv(fds[path], [memoryview(buffer)[:length]], pos)
            finally:
                with lock:
                    free.append(buffer)

        try:
            t0 = time.perf_counter()
            list(self.pool.map(one, jobs))
            seconds = time.perf_counter() - t0
        finally:
            for fd in fds.values():
                os.close(fd)
        return seconds, sum(end - start for spans in ranges.values() for start, end in merge(sorted(spans)))


def whole_files(paths: Iterable[str | Path]) -> dict[str, list[tuple[int, int]]]:
    """Ranges covering each file entirely."""
    return {str(p): [(0, os.path.getsize(p))] for p in paths if os.path.getsize(p) > 0}


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with touching or overlapping ranges joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def device_busy_ms(path: str | Path) -> int | None:
    """Milliseconds the block device holding ``path`` has had I/O in flight since boot (``io_ticks``, the
    10th field of ``/sys/dev/block/<major>:<minor>/stat``; see the kernel's Documentation/block/stat.rst);
    None where sysfs does not say.  Its growth over an interval, divided by the interval, is the
    fraction of the time the device was busy: a rate-free measure of whether a reader kept it busy."""
    st = os.stat(path)
    try:
        with open(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat") as f:
            return int(f.read().split()[9])
    except (OSError, ValueError, IndexError):
        return None
