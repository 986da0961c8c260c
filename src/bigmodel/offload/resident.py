"""Read the file-backed weights a model keeps in RAM from storage ahead of its first forward.

A model dispatched on the CPU holds its CPU part (``"cpu"`` in the device map) as zero-copy,
memory-mapped views of the checkpoint's files.  Untouched, the first forward faults those pages in
one read at a time, with the disk idle while it computes.  :func:`read_resident` instead reads
them on a background thread, module after module in the order given, through
``madvise(MADV_WILLNEED)`` (:func:`bigmodel.offload.in_order.will_need`) with a bounded number of
bytes in flight (``WINDOW_BYTES``: a page the forward needs now waits behind at most that much
queued I/O).  These pages are never released: they are what the CPU budget holds.  Nothing is read
into anonymous memory and no value changes; only file-backed mappings are advised.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..core.workers import worker
from . import readahead
from .readahead import Span

logger = logging.getLogger(__name__)

WINDOW_BYTES = 64 << 20  # bytes asked for and not yet read, at most


def _executor() -> ThreadPoolExecutor:
    return worker("bigmodel-resident")


def read_resident(groups: Iterable[Iterable[torch.Tensor]], available: int | None = None) -> Future | None:
    """Read the cold file-backed pages of weights meant to stay in RAM, in order, in the background.

    Groups whose first and last pages are in RAM already are skipped; reading stops before the
    bytes asked for exceed ``readahead.STREAM_FRACTION`` of the available memory (a CPU part
    larger than RAM is left to page faults).  ``BIGMODEL_READAHEAD=0`` turns it off.

    Args:
        groups: the tensors of each module, in the order they are to be read (non-CPU,
            non-contiguous and anonymous tensors are skipped; a span met twice is read once).
        available: available memory in bytes (default: ``MemAvailable`` now).

    Returns:
        The background read (done when every byte asked for is in RAM), or None when nothing is
        to be read (nothing file-backed and cold, or reading ahead off or unsupported).
    """
    if not readahead.supported() or os.environ.get(readahead.ENV, "1").strip() == "0":
        return None
    mappings, seen, todo = readahead.file_mappings(), set(), []
    for tensors in groups:
        tensors = list(tensors)
        spans = [span for span in readahead.file_spans(tensors, mappings) if span not in seen]
        seen.update(spans)
        if spans and not readahead.resident(spans):
            todo.append((spans, tensors))
    limit = readahead.STREAM_FRACTION * (available if available is not None else readahead.available_memory())
    total, jobs, keep = 0, [], []
    for spans, tensors in todo:
        size = sum(length for _, length in spans)
        if total + size > limit:
            break
        total += size
        jobs.extend(spans)
        keep.extend(tensors)
    if not jobs:
        return None
    logger.debug("Reading %.2f GB of weights kept in RAM ahead", total / 1e9)
    return _executor().submit(_read_in_order, jobs, WINDOW_BYTES, keep)


def _read_in_order(spans: list[Span], window: int, keep: list[torch.Tensor]) -> None:
    """Ask for the spans in order with ``window`` bytes in flight at most (:class:`bigmodel.offload.in_order.InOrder`), and
    return once every page has arrived (and is mapped: the forward takes no page fault on it)."""
    reads = readahead.InOrder(window)
    reads.read(spans, keep)
    reads.wait()
