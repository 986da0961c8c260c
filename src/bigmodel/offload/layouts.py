"""Where a module's offloaded values lie in their files, and where they go in a direct-read slot.

A :class:`Layout` is what :mod:`bigmodel.offload.direct` reads for one module: page-aligned runs of its
files (``O_DIRECT`` reads whole pages) laid one after the other in a slot, and each value's place in the
slot (at the same offset within a page as in its file's mapping, so kernels that depend on alignment
compute the same results).  Linux only (``O_DIRECT``, ``/proc/self/maps``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .drop import Mappings
from .file_spans import PAGE

GAP_BYTES = 1 << 20  # values of one file less than this apart are read in one run, the bytes between with them
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


class Run(NamedTuple):
    """One read: ``length`` bytes (page multiples) of file ``path`` from ``offset`` into the slot at ``at``,
    of which the first ``data`` hold values (the rest of the last page may lie past the file's end)."""

    path: str
    inode: int
    offset: int
    length: int
    at: int
    data: int = 0


class Layout(NamedTuple):
    """Where a module's values come from in their files and go to in a slot."""

    runs: tuple[Run, ...]
    views: tuple[tuple[str, int, torch.dtype, torch.Size], ...]  # (key, slot offset, dtype, shape)
    others: dict[str, torch.Tensor]  # values not read (not file-backed): passed on as they are
    sources: tuple[tuple[torch.Tensor, int], ...]  # the mapped values and their version counters
    spans: tuple[tuple[int, int], ...]  # page-aligned (address, length) of the mapped values
    nbytes: int  # slot bytes needed


def layout_possible() -> bool:
    """True where files can be read with ``O_DIRECT`` and slots' use counted (Linux, this torch)."""
    return bool(_O_DIRECT) and _USE_COUNT is not None


def layout(values: Mapping[str, torch.Tensor], mappings: Mappings) -> Layout | None:
    """How to read ``values`` (a hook's, as its weights map gives them) into a slot; None when it cannot.

    ``mappings`` must be read after the values' mappings were made (a fresh :class:`Mappings`: a row
    kept from before could describe another file mapped at the same address then).

    Values of one file lying less than ``GAP_BYTES`` apart are read in one run (a decoder layer's
    tensors lie one after the other in a safetensors file: one run); values further apart are separate runs,
    so the bytes between them are not read (a quantized layer's norms stay in the checkpoint, 10 MB apart
    around its full-precision weights, which its hook never uses)."""
    found = _placed(values, mappings) if layout_possible() else None
    if not found or not found[0]:
        return None
    placed, others = found
    runs: list[Run] = []
    views = []
    for path, inode, offset, size, key, value in sorted(placed, key=lambda p: (p[0], p[2])):
        last = runs[-1] if runs else None
        if last is None or (last.path, last.inode) != (path, inode) or offset >= last.offset + last.length + GAP_BYTES:
            last = Run(path, inode, offset - offset % PAGE, 0, last.at + last.length if last else 0)
            runs.append(last)
        end = offset + size
        if end > last.offset + last.data:
            runs[-1] = last = last._replace(length=-(-end // PAGE) * PAGE - last.offset, data=end - last.offset)
        views.append((key, last.at + offset - last.offset, value.dtype, value.shape))
    spans = tuple(_page_span(p[5].data_ptr(), p[3]) for p in placed)
    sources = tuple((p[5], p[5]._version) for p in placed)
    return Layout(tuple(runs), tuple(views), others, sources, spans, runs[-1].at + runs[-1].length)


def _placed(values: Mapping[str, torch.Tensor], mappings: Mappings) -> tuple[list[tuple], dict] | None:
    """``([(path, inode, file offset, bytes, key, value)] of the file-backed values, {key: other value})``,
    or None when a file-backed value cannot be viewed from a slot (not contiguous, misaligned)."""
    placed, others = [], {}
    for key, value in values.items():
        if type(value) not in (torch.Tensor, nn.Parameter) or value.device.type != "cpu" or value.numel() == 0:
            others[key] = value
            continue
        address, size = value.data_ptr(), value.numel() * value.element_size()
        row = mappings.find(address)
        if row is None or address + size > row.end:
            others[key] = value
        elif not value.is_contiguous() or address % value.element_size():
            return None
        else:
            placed.append((row.path, row.inode, row.offset + address - row.start, size, key, value))
    return placed, others


def _page_span(address: int, size: int) -> tuple[int, int]:
    low = address - address % PAGE
    return low, -(-(address + size) // PAGE) * PAGE - low
