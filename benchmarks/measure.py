"""What a child process measures: wall time, peak RSS and peak anonymous RSS.

Peak RSS comes from the kernel's high-water mark (``VmHWM``), reset at the start of a
measurement by writing ``5`` to ``/proc/self/clear_refs``.  Linux keeps no high-water
mark for anonymous memory, so a background thread samples ``/proc/self/statm``
(resident - shared pages = anonymous pages) every ``interval_s`` seconds.  All memory
figures are deltas over the value at the start of the measurement, in bytes.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

PAGE = os.sysconf("SC_PAGE_SIZE")


def _statm() -> tuple[int, int]:
    """(resident bytes, anonymous bytes) of this process, from ``/proc/self/statm``."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]), int(fields[2])
    return resident * PAGE, (resident - shared) * PAGE


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def rss_now() -> dict[str, int]:
    """Current RSS and anonymous RSS in bytes (``RssAnon`` from ``/proc/self/status``)."""
    return {"rss": _status_kib("VmRSS"), "anon": _status_kib("RssAnon")}


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class Probe:
    """Result of one :func:`probe` block: seconds and memory deltas in bytes."""

    seconds: float = 0.0
    peak_rss: int = 0
    peak_anon: int = 0
    start_rss: int = 0
    start_anon: int = 0
    _samples: list[int] = field(default_factory=list, repr=False)


@contextmanager
def probe(interval_s: float = 0.002) -> Iterator[Probe]:
    """Time a block and record its peak RSS / anonymous RSS above the starting values.

    Args:
        interval_s: sampling period of the anonymous-RSS thread, in seconds.

    Yields:
        A :class:`Probe` filled in when the block exits.
    """
    result = Probe()
    result.start_rss, result.start_anon = _statm()
    hwm_ok = _reset_peak()
    stop = threading.Event()
    peak = [result.start_rss, result.start_anon]

    def sample() -> None:
        while not stop.is_set():
            rss, anon = _statm()
            peak[0] = max(peak[0], rss)
            peak[1] = max(peak[1], anon)
            stop.wait(interval_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    try:
        yield result
    finally:
        result.seconds = time.perf_counter() - t0
        stop.set()
        thread.join()
        rss, anon = _statm()
        peak_rss = max(peak[0], rss)
        if hwm_ok:
            peak_rss = max(peak_rss, _status_kib("VmHWM"))
        result.peak_rss = peak_rss - result.start_rss
        result.peak_anon = max(peak[1], anon) - result.start_anon


def touch_tensors(tensors: Iterable[torch.Tensor]) -> int:
    """Read one byte of every 4 KiB page of each CPU tensor, so that every page is resident.

    Args:
        tensors: tensors to touch; each distinct storage is touched once.

    Returns:
        The number of bytes covered.

    Raises:
        RuntimeError: if a tensor is on the ``meta`` device (it was never loaded).
    """
    seen: set[int] = set()
    covered = 0
    for t in tensors:
        if t.device.type == "meta":
            raise RuntimeError(f"a tensor of shape {tuple(t.shape)} is still on meta after loading")
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        t = t.detach()
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        int(flat[::PAGE].sum()) + int(flat[-1])
        covered += flat.numel()
    return covered


def touch_file_mmap(path: str | Path, ranges: Iterable[tuple[int, int]] | None = None) -> mmap.mmap:
    """Map a file read-only and read one byte per 4 KiB page (the whole file or byte ranges).

    Returns:
        The mapping: its pages stay mapped (and count in RSS) until the caller closes it.
    """
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mm, dtype=np.uint8)
    for start, end in ranges if ranges is not None else [(0, view.size)]:
        part = view[start:end]
        if part.size:
            int(part[::PAGE].sum()) + int(part[-1])
    return mm


def dir_bytes(path: str | Path) -> int:
    """Total size in bytes of the regular files under ``path`` (0 if it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            total += os.path.getsize(os.path.join(root, name))
    return total


def read_files(paths: Iterable[str | Path]) -> None:
    """Read files once so that they sit in the page cache (a warm cache for every contender)."""
    for p in paths:
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass
