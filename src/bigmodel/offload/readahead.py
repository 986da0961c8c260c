"""Read offloaded weights from storage ahead of use, and let go of the ones already used.

Offloaded values backed by files (safetensors entries, ``.dat`` files of an offload folder)
are memory-mapped views.  Read through page faults, a cold view is read in small,
one-at-a-time requests.  :class:`ReadAhead` instead tells the kernel, for exactly the byte
ranges of the modules about to run, that they are needed (``madvise(MADV_WILLNEED)``, one call
per ``read_ahead_kb`` of the device, see :func:`advice_bytes`), in execution order with at most
``IN_FLIGHT_BYTES`` asked for and not arrived (:class:`InOrder`), up to ``window`` bytes ahead of
the module running now (page cache used by reads ahead stays bounded); from the model's forward
start on (:meth:`ReadAhead.start`), so the first offloaded module is read while the ones before
it compute.  When the offloaded bytes exceed what the page cache can hold, a module's ranges are
released once it has run (``madvise(MADV_PAGEOUT)``, else ``MADV_COLD``: clean file pages are
dropped, so the kernel does not evict what is needed next instead), except for a prefix of the
execution order that fits in half of the available memory and stays cached from one forward to
the next (fewer bytes read per forward).

Both calls are hints: they never change a value (a released page is read again from its file
on the next access), and they are only made on spans of file-backed mappings (never on
anonymous memory, which MADV_PAGEOUT could swap out).  They run on one background thread.
Nothing is done while the offloaded bytes are in RAM already: at the start of each forward
``mincore`` is asked about the first pages of ``PROBES`` modules spread over the order (all
modules' first and last pages while reading ahead); a warm page cache then costs a few
microseconds per forward and one attribute check per module.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import ctypes.util
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..core.workers import worker
from .pages import all_in_ram, available_memory

logger = logging.getLogger(__name__)

ENV = "BIGMODEL_READAHEAD"  # "0" turns reading ahead from storage off
MADV_WILLNEED = 3
MADV_COLD = 20
MADV_PAGEOUT = 21
WINDOW_BYTES = 512 << 20  # default bytes read ahead of the running module
PROBES = 8  # modules whose first pages are checked at the start of each forward while not reading ahead
RETAIN_FRACTION = 0.5  # of the available memory, for the prefix kept cached between forwards
STREAM_FRACTION = 0.8  # offloaded bytes above this fraction of available memory: release after use
_SAMPLE_PAGES = 16
MIN_ADVICE_BYTES = 128 << 10  # one WILLNEED per this many bytes where the device's read-ahead size is unknown
IN_FLIGHT_BYTES = 64 << 20  # bytes asked for and not yet arrived, at most (InOrder)

Span = tuple[int, int]  # (page-aligned address, length in bytes)


def _load_libc() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_ADVICE_BYTES: dict[str, int] = {}  # device ("fe:01") -> bytes one WILLNEED reads at most
_ADVICE_SPANS: list[tuple[int, int, int]] = []  # (start, end, advice bytes) of the file mappings last listed


def _executor() -> ThreadPoolExecutor:
    return worker("bigmodel-readahead")


def supported() -> bool:
    """True where ``madvise``/``mincore`` and ``/proc/self/maps`` are available (Linux)."""
    return _LIBC is not None and os.path.exists("/proc/self/maps")


def advice_bytes(device: str) -> int:
    """Bytes one ``madvise(MADV_WILLNEED)`` reads at most from files on ``device`` (``"fe:01"``, hex).

    The kernel reads at most the device's read-ahead size per call (``read_ahead_kb``; more only
    up to its largest request, ``max_sectors_kb``): :func:`will_need` splits longer spans into
    pieces of this size.  ``MIN_ADVICE_BYTES`` where sysfs does not say.
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

    Also notes, for :func:`will_need`, how many bytes one advice reads on each mapping's device.
    """
    global _ADVICE_SPANS
    spans, advice = [], []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[4] == "0" or not parts[5].startswith("/") or parts[5].startswith("/dev/"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            spans.append((lo, hi))
            advice.append((lo, hi, advice_bytes(parts[3])))
    spans.sort()
    advice.sort()
    _ADVICE_SPANS = advice
    return spans


def file_spans(tensors: Iterable[torch.Tensor], mappings: Sequence[tuple[int, int]]) -> list[Span]:
    """Page-aligned spans of the CPU tensors whose memory lies inside one of ``mappings`` (file-backed)."""
    starts = [lo for lo, _ in mappings]
    out: list[Span] = []
    for tensor in tensors:
        if tensor.device.type != "cpu" or tensor.numel() == 0 or not tensor.is_contiguous():
            continue
        address = tensor.data_ptr()
        end = address + tensor.numel() * tensor.element_size()
        i = bisect.bisect_right(starts, address) - 1
        if i < 0 or end > mappings[i][1]:
            continue
        lo = address - address % _PAGE
        out.append((lo, -(-end // _PAGE) * _PAGE - lo))
    return out


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
            ranges.append((address - address % _PAGE, -(-end // _PAGE) * _PAGE))
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def resident(spans: Iterable[Span], last: bool = True) -> bool:
    """True if the first and (with ``last``) last ``_SAMPLE_PAGES`` pages of every span are in RAM (``mincore``)."""
    vec = ctypes.create_string_buffer(_SAMPLE_PAGES)
    for address, length in spans:
        pages = length // _PAGE
        for start in {address, address + max(0, pages - _SAMPLE_PAGES) * _PAGE} if last else (address,):
            count = min(pages, _SAMPLE_PAGES)
            if _LIBC.mincore(ctypes.c_void_p(start), count * _PAGE, vec) != 0:
                return False
            if not all_in_ram(vec.raw[:count]):
                return False
    return True


def pieces(span: Span) -> list[Span]:
    """``span`` cut into the pieces one ``madvise(MADV_WILLNEED)`` reads whole (see :func:`advice_bytes`)."""
    address, length = span
    mappings = _ADVICE_SPANS
    i = bisect.bisect_right(mappings, (address, float("inf"), 0)) - 1
    step = mappings[i][2] if i >= 0 and address < mappings[i][1] else MIN_ADVICE_BYTES
    return [(address + offset, min(step, length - offset)) for offset in range(0, length, step)]


def will_need(spans: Iterable[Span]) -> None:
    """Ask the kernel to read the spans into the page cache now (asynchronous reads; returns at once).

    One advice per :func:`advice_bytes` of a span (the kernel reads no more per call: a whole
    tensor in one call would have only its first megabytes read).
    """
    for span in spans:
        for address, length in pieces(span):
            _LIBC.madvise(ctypes.c_void_p(address), length, MADV_WILLNEED)


def release(spans: Iterable[Span]) -> None:
    """Drop the spans' clean file pages from memory (``MADV_PAGEOUT``; ``MADV_COLD`` where unsupported)."""
    for address, length in spans:
        if _LIBC.madvise(ctypes.c_void_p(address), length, MADV_PAGEOUT) != 0:
            _LIBC.madvise(ctypes.c_void_p(address), length, MADV_COLD)


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
        self._in_flight: collections.deque[tuple[Span, object]] = collections.deque()
        self._waiting = 0

    def read(self, spans: Iterable[Span], keep: object = None) -> None:
        """Ask for ``spans`` after everything asked for before.

        Args:
            spans: page-aligned spans of file-backed mappings.
            keep: what holds those mappings (the tensors): kept until the pieces have arrived.
        """
        for span in spans:
            for piece in pieces(span):
                while self._in_flight and self._waiting + piece[1] > self.window:
                    self._arrived()
                will_need([piece])
                self._in_flight.append((piece, keep))
                self._waiting += piece[1]

    def wait(self) -> None:
        """Return once every piece asked for has arrived."""
        while self._in_flight:
            self._arrived()

    def _arrived(self) -> None:
        (address, length), _ = self._in_flight.popleft()
        view = torch.frombuffer((ctypes.c_uint8 * length).from_address(address), dtype=torch.uint8)
        view[::_PAGE].sum()
        self._waiting -= length


class ReadAhead:
    """Reads the file-backed offloaded weights of the next modules ahead, in execution order.

    Args:
        read: ``read(hook) -> {name: tensor}``, the hook's offloaded values (mapped views).
        window: bytes read ahead of the running module (at least the largest module's).
        available: available memory in bytes (default: ``MemAvailable`` when reading ahead starts).
    """

    def __init__(self, read: Callable[[Any], dict[str, torch.Tensor]], window: int = WINDOW_BYTES,
                 available: int | None = None) -> None:
        self.read = read
        self.window = window
        self.available = available
        self.active = False  # reading ahead (the weights were found not resident at a forward's start)
        self.streaming = False  # releasing used modules (the offloaded bytes exceed the page cache)
        self._spans: list[list[Span]] | None = None
        self._bytes: list[int] = []
        self._retained = 0  # modules 0 .. _retained - 1 of the order are never released
        self._probes: list[Span] = []  # the first span of at most PROBES modules spread over the order
        self._ahead = 0  # order positions < _ahead have been advised in this pass
        self._early = False  # this pass was begun by start(), before order[0]'s module started
        self.enabled = supported() and os.environ.get(ENV, "1").strip() != "0"
        self._lock = threading.Lock()  # forwards of one model from several threads share this state
        self._reads = InOrder()  # used on the read-ahead thread only
        self._values: list[dict[str, torch.Tensor]] = []  # the views the spans lie in (keeps their mappings)

    def reset(self) -> None:
        """Forget the spans (call when a weights map's values change)."""
        with self._lock:
            self._spans, self.active, self.streaming, self._early, self._values = None, False, False, False, []

    def first_resident(self) -> bool:
        """True if the first page of the first module with file-backed values is in RAM (one ``mincore``
        call), or nothing is read ahead (turned off, no file-backed value); False before :meth:`start`."""
        probes = self._probes
        return not self.enabled or (self._spans is not None and (not probes or resident(probes[:1], last=False)))

    def start(self, order: Sequence[Any]) -> None:
        """The model's forward starts, before ``order[0]()``'s module: begin the pass now, so that the first
        offloaded modules are read while the modules before them (embeddings, resident layers) compute.
        The first offloaded module's own start then goes on with this pass instead of beginning another
        (during the first forward too, along the guessed order), unless :meth:`reset` came between."""
        if self.enabled:
            with self._lock:
                self._early = False
                self._advance(order, 0, new_pass=True)
                self._early = True

    def advance(self, order: Sequence[Any], index: int, new_pass: bool = False) -> None:
        """Module ``order[index]()`` starts: read ahead of it, release the one before it (see :meth:`_advance`)."""
        if self.enabled:
            with self._lock:
                self._advance(order, index, new_pass)

    def _advance(self, order: Sequence[Any], index: int, new_pass: bool = False) -> None:
        """Module ``order[index]()`` starts: read ahead of it, release the one before it.

        Args:
            order: weak references to the hooks, in execution order (the same list for a whole
                pass; a different order needs :meth:`reset` first).
            index: position of the starting hook in ``order``.
            new_pass: this module starts a forward although it is not ``order[0]`` (the first
                forward, run along a guessed order).  ``index == 0`` always starts one.
        """
        if (new_pass or index == 0) and not self._early:  # a pass start() began goes on (reset() ends it)
            self._new_pass(order)
        self._early = False
        if not self.active:
            return
        count = len(order)
        jobs: list[tuple[Callable, list[Span], object]] = []
        ahead = sum(self._bytes[index + 1:self._ahead])
        position = max(self._ahead, index)
        while position < count:
            if position > index:
                if ahead + self._bytes[position] > self.window:
                    break
                ahead += self._bytes[position]
            jobs.append((self._reads.read, self._spans[position], self._values))  # type: ignore[index]
            position += 1
        self._ahead = max(self._ahead, position)
        previous = index - 1
        if self.streaming and previous >= self._retained:
            jobs.append((_release, self._spans[previous], self._values))  # type: ignore[index]
        if jobs:
            _executor().submit(_run, [job for job in jobs if job[1]])

    def _new_pass(self, order: Sequence[Any]) -> None:
        self._ahead = 0
        if self._spans is None or len(self._spans) != len(order):
            self._learn(order)
        was = self.active
        if was:  # while reading ahead: every module's spans (the I/O dominates this check)
            self.active = not all(resident(spans) for spans in self._spans or [])
        else:  # a few modules spread over the order, first pages only: microseconds
            self.active = not resident(self._probes, last=False)
        if self.active and not was:
            self._plan()

    def _learn(self, order: Sequence[Any]) -> None:
        values = [self.read(hook) if (hook := ref()) is not None else {} for ref in order]
        mappings = file_mappings()  # after the reads: they map the files not mapped yet (lazily opened shards)
        self._spans = [file_spans(tensors.values(), mappings) for tensors in values]
        self._values = [tensors if spans else {} for tensors, spans in zip(values, self._spans)]  # file-backed only
        self._bytes = [sum(length for _, length in spans) for spans in self._spans]
        with_bytes = [i for i, size in enumerate(self._bytes) if size]
        self._probes = [self._spans[i][0] for i in with_bytes[:: -(-len(with_bytes) // PROBES) or 1]]  # <= PROBES modules
        self.window = max(self.window, max(self._bytes, default=0))

    def _plan(self) -> None:
        available = self.available if self.available is not None else available_memory()
        total = sum(self._bytes)
        self.streaming = available > 0 and total > STREAM_FRACTION * available
        self._retained = 0
        if self.streaming:
            keep = RETAIN_FRACTION * available - 2 * self.window
            while self._retained < len(self._bytes) and keep - self._bytes[self._retained] >= 0:
                keep -= self._bytes[self._retained]
                self._retained += 1
        logger.debug("Reading offloaded weights ahead: %.2f GB in %d modules, window %.0f MB, %s",
                      total / 1e9, len(self._bytes), self.window / 1e6,
                      f"releasing used modules after the first {self._retained}" if self.streaming else "no release")


def _release(spans: list[Span], keep: object) -> None:
    release(spans)  # ``keep`` (the views) holds the mappings until the job has run


def _run(jobs: list[tuple[Callable, list[Span], object]]) -> None:
    for fn, spans, keep in jobs:
        fn(spans, keep)
