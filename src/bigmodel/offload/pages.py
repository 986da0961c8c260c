"""Memory pages under CPU tensors: fault them in, or ask the kernel whether they are in RAM.

Used to read file-backed (memory-mapped) weights ahead of their use: :func:`touch_pages` makes
the page faults (the disk reads) happen now, on the calling thread; :func:`pages_resident`
asks ``mincore`` without touching anything.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable

import torch

PAGE_BYTES = 4096  # touch_pages reads one byte per this many bytes


def touch_pages(tensor: torch.Tensor) -> None:
    """Read one byte per memory page of a CPU tensor, so its file-backed pages are faulted in now."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
        return
    try:
        raw = tensor.detach().reshape(-1).view(torch.uint8)
    except RuntimeError:
        return
    raw[::PAGE_BYTES].sum()


def load_mincore() -> Callable | None:
    """libc's ``mincore(addr, length, vec)`` where the platform has it (Linux, macOS), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        mincore = libc.mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    mincore.restype = ctypes.c_int
    return mincore


MINCORE = load_mincore()
_SYSTEM_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else PAGE_BYTES
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore sets bit 0 of a page's byte when it is resident


def all_in_ram(vec: bytes) -> bool:
    """True if every page of a ``mincore`` result vector (one byte per page) is resident."""
    return b"\x00" not in vec.translate(_LOW_BIT)
_WINDOWS = 2  # pages_resident samples this many windows of a large tensor (first and last) ...
_WINDOW_PAGES = 32  # ... of this many pages each


def pages_resident(tensor: torch.Tensor) -> bool:
    """True if the memory pages under a CPU tensor are in RAM (so reading it ahead gains nothing).

    Asks the kernel (``mincore``) without touching the pages.  The kernel's cost grows with the
    pages asked about (about 3 µs per MB), so a large tensor is sampled: ``_WINDOWS`` windows
    of ``_WINDOW_PAGES`` pages (its first and last), one ``mincore`` call each (about 5 µs).
    A partly evicted tensor may then pass as resident and fault its missing pages on the
    forward thread (correct, only slower).  False when unknown (no ``mincore``, a
    non-contiguous or non-CPU tensor): the caller reads ahead anyway.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return True
    if MINCORE is None:
        return False
    start = tensor.data_ptr() & ~(_SYSTEM_PAGE - 1)
    pages = -(-(tensor.data_ptr() + nbytes - start) // _SYSTEM_PAGE)
    if pages <= _WINDOWS * _WINDOW_PAGES:
        windows = [(start, pages)]
    else:
        step = (pages - _WINDOW_PAGES) // (_WINDOWS - 1)
        windows = [(start + i * step * _SYSTEM_PAGE, _WINDOW_PAGES) for i in range(_WINDOWS)]
    vec = ctypes.create_string_buffer(max(count for _, count in windows))
    for address, count in windows:
        if MINCORE(address, count * _SYSTEM_PAGE, vec) != 0 or not all_in_ram(vec.raw[:count]):
            return False
    return True


def available_memory() -> int:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes (0 when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
