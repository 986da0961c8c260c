"""Drop the pages of used file-backed spans from memory with little CPU time.

A streaming read-ahead releases each module once it has run.  ``madvise(MADV_PAGEOUT)`` reclaims a
span's pages itself: 0.26-0.45 s of CPU time per 810 MB on the 2-core development machine
(BENCHMARKS.md, sessions 7 and 11), a tenth of what two CPUs give a forward there.  Unmapping the
span (``MADV_DONTNEED``) and then dropping its file range from the page cache
(``posix_fadvise(POSIX_FADV_DONTNEED)``) frees the same pages in a few tens of milliseconds.

``MADV_DONTNEED`` would also discard a page written in place in a private mapping (torch maps files
privately and writable, ``UntypedStorage.from_file(shared=False)``): a span holding such a page (in
``/proc/self/pagemap``: present, not a file page) is not dropped here, and the caller pages it out,
which keeps the written page.  Neither call changes a value read later: a dropped page is read
again from its file.  Linux only; elsewhere (or without ``/proc/self/pagemap``) nothing is dropped.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
from collections.abc import Iterable

import numpy as np

from .file_spans import _LIBC, PAGE, MappingRow, Span, file_mapping_rows

logger = logging.getLogger(__name__)

MADV_DONTNEED = 4
_PRESENT = np.uint64(1 << 63)
_SWAPPED = np.uint64(1 << 62)  # a private copy swapped out: not present, still written
_FILE_PAGE = np.uint64(1 << 61)  # a file page or shared anonymous memory: not a private copy


class Mappings:
    """This process's file mappings (:class:`MappingRow`), read at the first lookup and again when an
    address is unknown (a row found may be stale: a mapping since replaced by another at the same
    address)."""

    def __init__(self) -> None:
        self._table: tuple[list[MappingRow], list[int]] = ([], [])  # rows and their starts, replaced together

    def find(self, address: int, fresh: bool = False) -> MappingRow | None:
        """The row holding ``address`` (``fresh``: from ``/proc/self/maps`` read now), or None.

        A row kept from an earlier read is checked first (``/proc/self/map_files``: the mapping with
        those bounds still maps that inode): a model deleted and another loaded can reuse the addresses."""
        row = None if fresh else self._lookup(address)
        if row is not None and not _current(row):
            row = None
        if row is None:
            rows = file_mapping_rows()
            self._table = (rows, [row.start for row in rows])  # one assignment: other threads look up too
            row = self._lookup(address)
        return row

    def _lookup(self, address: int) -> MappingRow | None:
        rows, starts = self._table
        i = bisect.bisect_right(starts, address) - 1
        return rows[i] if i >= 0 and address < rows[i].end else None


def _current(row: MappingRow) -> bool:
    """True if the mapping ``row`` describes is still there, of the same file."""
    try:
        return os.stat(f"/proc/self/map_files/{row.start:x}-{row.end:x}").st_ino == row.inode
    except OSError:  # gone, or map_files unreadable here: read the maps again
        return False


_MAPPINGS = Mappings()
_PAGEMAP: dict[int, int | None] = {}  # pid -> its /proc/self/pagemap descriptor (None: unavailable)


def drop(spans: Iterable[Span]) -> list[Span]:
    """Drop the pages of ``spans`` (page-aligned, in file mappings) from memory where that is safe and cheap.

    Returns:
        The spans not dropped (written in place, not in one file mapping, or the calls unavailable):
        the caller releases them another way (``MADV_PAGEOUT``).
    """
    left = []
    for span in spans:
        if not _drop_one(span):
            left.append(span)
    return left


def _drop_one(span: Span) -> bool:
    address, length = span
    row = _MAPPINGS.find(address) if _LIBC is not None and hasattr(os, "posix_fadvise") else None
    if row is None or address + length > row.end or written(address, length):
        return False
    fd = open_inode(row.path, row.inode)
    if fd is None:  # the row may be stale (the file mapped at that address since): ask once more
        row = _MAPPINGS.find(address, fresh=True)
        fd = None if row is None or address + length > row.end else open_inode(row.path, row.inode)
    if fd is None:
        return False
    try:
        if _LIBC.madvise(ctypes.c_void_p(address), length, MADV_DONTNEED) != 0:
            return False
        try:
            os.posix_fadvise(fd, row.offset + address - row.start, length, os.POSIX_FADV_DONTNEED)
        except OSError as error:  # unmapped but cached: the kernel reclaims the pages when it needs them
            logger.debug("posix_fadvise(DONTNEED) of %s failed: %s", row.path, error)
    finally:
        os.close(fd)
    return True


def open_inode(path: str, inode: int) -> int | None:
    """A read-only descriptor of file ``inode`` at ``path`` (the caller closes it), or None (deleted, replaced
    or unreadable: a file written anew at the same path, e.g. an offload folder's, is another inode).

    Opened for each drop, never kept: a descriptor kept open per path held every file a deleted model
    had mapped (and removed offload folders' disk space) until the process ended."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    if os.fstat(fd).st_ino != inode:
        os.close(fd)
        return None
    return fd


def written(address: int, length: int) -> bool:
    """True if a page of the span is a private copy (written in place; in RAM or swapped out), or when that
    cannot be known."""
    fd = _pagemap()
    if fd is None:
        return True
    try:
        raw = os.pread(fd, 8 * (length // PAGE), 8 * (address // PAGE))
    except OSError:
        return True
    entries = np.frombuffer(raw, dtype=np.uint64)
    private = (entries & (_PRESENT | _SWAPPED) != 0) & (entries & _FILE_PAGE == 0)
    return len(raw) != 8 * (length // PAGE) or bool(np.any(private))


def _pagemap() -> int | None:
    """This process's pagemap (opened again in a forked child: an inherited one reads the parent's)."""
    pid = os.getpid()
    if pid not in _PAGEMAP:
        try:
            _PAGEMAP[pid] = os.open("/proc/self/pagemap", os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            _PAGEMAP[pid] = None
    return _PAGEMAP[pid]
