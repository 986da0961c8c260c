"""Where offloaded weights lie in this process's file mappings, as page-aligned spans to advise.

An offloaded value backed by a file (a safetensors entry, a ``.dat`` file of an offload folder) is
a memory-mapped view: its bytes are a span of addresses inside a mapping of a regular file
(``/proc/self/maps``).  :func:`file_spans` finds those spans; :func:`pieces` cuts a span into the
pieces one ``madvise(MADV_WILLNEED)`` reads whole, which is the read-ahead size of the file's
block device (``/sys/dev/block/<major>:<minor>/queue/read_ahead_kb``, see :func:`advice_bytes`);
:func:`resident` asks ``mincore`` whether a span's first and last pages are in RAM.  Linux only:
callers check :func:`supported` first.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import os
from collections.abc import Iterable, Sequence
from typing import NamedTuple
from typing import Any

import torch

from .pages import all_in_ram

MIN_ADVICE_BYTES = 128 << 10  # one WILLNEED per this many bytes where the device's read-ahead size is unknown
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

Span = tuple[int, int]  # (page-aligned address, length in bytes)

_ADVICE_BYTES: dict[str, int] = {}  # device ("fe:01") -> bytes one WILLNEED reads at most
_ADVICE_SPANS: list[tuple[int, int, int]] = []  # (start, end, advice bytes) of the file mappings last listed
_SAMPLE_PAGES = 16  # pages checked at each end of a span by resident()


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def advice_bytes(device: str) -> int:
    """Bytes one ``madvise(MADV_WILLNEED)`` reads at most from files on ``device`` (``"fe:01"``, hex).

    The kernel reads at most the device's read-ahead size per call (``read_ahead_kb``; more only
    up to its largest request, ``max_sectors_kb``): :func:`pieces` cuts longer spans into pieces
    of this size.  ``MIN_ADVICE_BYTES`` where sysfs does not say.
    """
    known = _ADVICE_BYTES.get(device)
    if known is not None:
        return known
    found = MIN_ADVICE_BYTES
    try:
        number = ":".join(str(int(part, 16)) for part in device.split(":"))
    except ValueError:
        number = ""
    queues = [f"/sys/dev/block/{number}/queue", f"/sys/dev/block/{number}/../queue"]  # a disk, a partition
    for path in [f"{queue}/read_ahead_kb" for queue in queues] + [f"/sys/class/bdi/{number}/read_ahead_kb"]:
        try:
            with open(path) as f:
                found = max(MIN_ADVICE_BYTES, int(f.read()) << 10)
            break
        except (OSError, ValueError):
            continue
    _ADVICE_BYTES[device] = found
    return found


def file_mappings() -> list[tuple[int, int]]:
    """Sorted (start, end) addresses of this process's mappings of regular files (from ``/proc/self/maps``).

    Also notes, for :func:`bigmodel.offload.in_order.will_need`, how many bytes one advice reads on each mapping's device.
    """
    global _ADVICE_SPANS
    rows = file_mapping_rows()
    _ADVICE_SPANS = [(row.start, row.end, advice_bytes(row.device)) for row in rows]
    return [(row.start, row.end) for row in rows]


class MappingRow(NamedTuple):
    """One mapping of a regular file, from ``/proc/self/maps``."""

    start: int
    end: int
    offset: int  # in the file, of ``start``
    device: str  # ``"fe:01"`` (hex major:minor)
    inode: int
    path: str


def file_mapping_rows() -> list[MappingRow]:
    """This process's mappings of regular files (not ``/dev/``), sorted by address."""
    rows = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[4] == "0" or not parts[5].startswith("/") or parts[5].startswith("/dev/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            rows.append(MappingRow(lo, hi, int(parts[2], 16), parts[3], int(parts[4]), parts[5].rstrip("\n")))
    rows.sort()
    return rows


def file_spans(tensors: Iterable[torch.Tensor], mappings: Sequence[tuple[int, int]]) -> list[Span]:
    """Page-aligned spans of the CPU tensors whose memory lies inside one of ``mappings`` (file-backed)."""
    out: list[Span] = []
    for _, address, end in _file_ranges(tensors, mappings):
        lo = address - address % PAGE
        out.append((lo, -(-end // PAGE) * PAGE - lo))
    return out


def inner_spans(tensors: Iterable[torch.Tensor], mappings: Sequence[tuple[int, int]]) -> list[Span]:
    """The pages wholly inside the memory of the CPU tensors that lies in one of ``mappings``.

    Tensors that touch in one mapping are merged first (a decoder layer's, one after the other in its
    file: one span).  A page the tensors share with other memory (the tensor before or after them in the
    file, another module's) is left out: dropping it would evict what that module needs next."""
    out: list[Span] = []
    for address, end in _merged(_file_ranges(tensors, mappings)):
        lo, hi = -(-address // PAGE) * PAGE, end - end % PAGE
        if hi > lo:
            out.append((lo, hi - lo))
    return out


def _file_ranges(tensors: Iterable[torch.Tensor], mappings: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``(mapping index, start, end)`` addresses of each contiguous CPU tensor lying inside one of ``mappings``."""
    starts = [lo for lo, _ in mappings]
    out = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
            continue
        address = tensor.data_ptr()
        end = address + tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and end <= mappings[i][1]:
            out.append((i, address, end))
    return out


def pieces(span: Span) -> list[Span]:
    """``span`` cut into the pieces one ``madvise(MADV_WILLNEED)`` reads whole (see :func:`advice_bytes`)."""
    address, length = span
    mappings = _ADVICE_SPANS
    i = bisect.bisect_right(mappings, (address, float("inf"), 0)) - 1
    step = mappings[i][2] if i >= 0 and address < mappings[i][1] else MIN_ADVICE_BYTES
    return [(address + offset, min(step, length - offset)) for offset in range(0, length, step)]


def supported() -> bool:
    """True where ``madvise``/``mincore`` and ``/proc/self/maps`` are available (Linux)."""
    return _LIBC is not None and os.path.exists("/proc/self/maps")


def merged_spans(tensors: Iterable[torch.Tensor]) -> list[Span]:
    """Page-aligned spans covering the CPU tensors' memory, adjacent ones merged (a decoder layer's
    tensors, stored one after the other in a file: one span); empty when one is not a contiguous CPU
    tensor, or ``mincore`` is unavailable (nothing can be asked)."""
    if _LIBC is None:
        return []
    ranges = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            return []
        if tensor.numel():
            address = tensor.data_ptr()
            end = address + tensor.numel() * tensor.element_size()
            ranges.append((0, address - address % PAGE, -(-end // PAGE) * PAGE))
    return [(lo, hi - lo) for lo, hi in _merged(ranges)]


def _merged(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """``(start, end)`` of the ``(key, start, end)`` ranges, those of one key that touch or overlap merged."""
    merged: list[list[int]] = []
    for key, lo, hi in sorted(ranges):
        if merged and merged[-1][0] == key and lo <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], hi)
        else:
            merged.append([key, lo, hi])
    return [(lo, hi) for _, lo, hi in merged]


def resident(spans: Iterable[Span], last: bool = True) -> bool:
    """True if the first and (with ``last``) last ``_SAMPLE_PAGES`` pages of every span are in RAM (``mincore``)."""
    vec = ctypes.create_string_buffer(_SAMPLE_PAGES)
    for address, length in spans:
        pages = length // PAGE
        for start in {address, address + max(0, pages - _SAMPLE_PAGES) * PAGE} if last else (address,):
            count = min(pages, _SAMPLE_PAGES)
            if _LIBC.mincore(ctypes.c_void_p(start), count * PAGE, vec) != 0:
                return False
            if not all_in_ram(vec.raw[:count]):
                return False
    return True
