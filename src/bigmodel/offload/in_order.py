"""Ask the kernel for file-backed spans in order, with a bounded number of bytes asked for and not arrived.

``madvise(MADV_WILLNEED)`` starts asynchronous reads of a mapping's pages into the page cache;
:class:`InOrder` asks piece by piece and waits for the oldest piece before asking for more, so that
the pieces arrive in the order asked for (the storage read-ahead's modules, the resident read's
CPU part).
"""

from __future__ import annotations

import collections
import ctypes
import threading
from collections.abc import Iterable

import torch

from .file_spans import _LIBC, Span, pieces
from .file_spans import PAGE as _PAGE

MADV_WILLNEED = 3
IN_FLIGHT_BYTES = 64 << 20  # bytes asked for and not yet arrived, at most (InOrder)
IN_FLIGHT_MAX = 128 << 20  # the same for modules of more than 6 x 128 MB (see in_flight_for)


def in_flight_for(largest: int) -> int:
    """Bytes :class:`InOrder` keeps asked for and not yet arrived when the largest module read ahead has
    ``largest`` bytes: a sixth of it, from ``IN_FLIGHT_BYTES`` (64 MB) to ``IN_FLIGHT_MAX`` (128 MB).

    Measured here (BENCHMARKS.md, session 8): with 810 MB decoder layers, 128 MB in flight read the
    first token's 24 GB from storage at a median 0.94x the time of 64 MB (the disk had reads in
    flight 0.96-0.97 of the time against 0.92-0.95) and decoded as fast, where 256 MB slowed decode;
    with ~100 MB layers 64 MB stays best (cold forwards 1.19x the cold read against 1.33x at 128 MB):
    with modules not much larger than the window, a deeper queue brings them in out of order.
    """
    return min(IN_FLIGHT_MAX, max(IN_FLIGHT_BYTES, largest // 6))


def will_need(spans: Iterable[Span]) -> None:
    """Ask the kernel to read the spans into the page cache now (asynchronous reads; returns at once).

    One advice per :func:`advice_bytes` of a span (the kernel reads no more per call: a whole
    tensor in one call would have only its first megabytes read).
    """
    for span in spans:
        for address, length in pieces(span):
            _LIBC.madvise(ctypes.c_void_p(address), length, MADV_WILLNEED)


class InOrder:
    """Asks for spans piece by piece (:func:`will_need`), in the order given, with at most ``window``
    bytes asked for and not yet arrived: the oldest piece is waited for before the next is asked.

    A deep queue of reads completes in no particular order (a disk serves its queued requests side
    by side): with 600 MB asked for at once, the second module of a cold forward arrived with the
    sixth.  Kept short, the queue still keeps the disk busy, and modules arrive in the order they
    run.  Waiting reads one byte per page of the piece (torch, without the GIL): its pages are
    then mapped too, so the forward takes no page fault on them.  Used from one thread at a time.

    Args:
        window: bytes in flight at most (at least one piece is always in flight).
    """

    def __init__(self, window: int = IN_FLIGHT_BYTES) -> None:
        self.window = window
        # Held while a piece's ``used`` is checked and the piece asked for or touched: a release passes
        # through it after setting ``used`` (:meth:`settled`), so no piece of a released module is asked
        # for or read back once its release has begun.
        self.asking = threading.Lock()
        self._in_flight: collections.deque[tuple[Span, object, threading.Event | None]] = collections.deque()
        self._waiting = 0

    def read(self, spans: Iterable[Span], keep: object = None, used: threading.Event | None = None) -> None:
        """Ask for ``spans`` after everything asked for before.

        Args:
            spans: page-aligned spans of file-backed mappings.
            keep: what holds those mappings (the tensors): kept until the pieces have arrived.
            used: set once the module the spans belong to has run and is being released: its pieces
                not asked for yet are not, and those asked for are not waited for (touching them
                would read back what the release drops).
        """
        for span in spans:
            for piece in pieces(span):
                if used is not None and used.is_set():
                    return
                while self._in_flight and self._waiting + piece[1] > self.window:
                    self._arrived()
                with self.asking:
                    if used is not None and used.is_set():
                        return
                    will_need([piece])
                self._in_flight.append((piece, keep, used))
                self._waiting += piece[1]

    def wait(self) -> None:
        """Return once every piece asked for has arrived."""
        while self._in_flight:
            self._arrived()

    def forget(self) -> None:
        """Stop tracking the pieces asked for so far, without waiting for them (a new pass reads anew:
        touching the last pass's pieces would read back whatever the kernel dropped meanwhile, one
        page fault at a time, before the new pass's first read is asked for)."""
        self._in_flight.clear()
        self._waiting = 0

    def _arrived(self) -> None:
        (address, length), _, used = self._in_flight.popleft()
        self._waiting -= length
        with self.asking:
            if used is None or not used.is_set():
                view = torch.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8)
                view[::_PAGE].sum()

    def settled(self) -> None:
        """Return once no piece is being asked for or touched: called after setting a module's ``used``,
        every later check of it sees it set."""
        with self.asking:
            pass
