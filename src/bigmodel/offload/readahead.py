"""Read offloaded weights from storage ahead of use, and let go of the ones already used.

Offloaded values backed by files (safetensors entries, ``.dat`` files of an offload folder)
are memory-mapped views.  Read through page faults, a cold view is read in small,
one-at-a-time requests.  :class:`ReadAhead` instead tells the kernel, for exactly the byte
ranges of the modules about to run, that they are needed (``madvise(MADV_WILLNEED)``, one call
per ``read_ahead_kb`` of the device, see :func:`advice_bytes`), in execution order with at most
64-128 MB asked for and not arrived (:class:`InOrder`, :func:`in_flight_for`), up to ``window`` bytes ahead of
the module running now (page cache used by reads ahead stays bounded); from the model's forward
start on (:meth:`ReadAhead.start`), so the first offloaded module is read while the ones before
it compute.  When the offloaded bytes exceed what the page cache can hold, a module's ranges are
released once it has run (:func:`release`; the pages wholly inside its tensors, :func:`inner_spans`: a
page shared with a neighbour in the file stays; clean file pages are dropped, so the kernel does not
evict what is needed next instead), except for modules spread
evenly over the execution order that fit in half of the available memory and stay cached from one
forward to the next (fewer bytes read per forward; :func:`spread_kept`).  While streaming, reading
reaches ``STREAM_AHEAD`` (2) of the largest modules ahead (the kept modules take from the first half
of the available memory, these from the second: a module that computes slowly, or the resident layers
before the first offloaded one, no longer find the disk idle with one module read), counting only
the bytes of released modules (the kept ones are in RAM), and the end of a pass
reads on into the next one's first released modules (:meth:`ReadAhead._wrap`): decoding, the
disk never waits for a forward's start.  Modules are read with ``O_DIRECT`` into reused slots
rather than through the page cache where they can be (:mod:`bigmodel.offload.direct`; their hooks
take the slots' views, :meth:`ReadAhead.take_direct`): every released module, and the others not in
RAM yet beyond a per-forward budget (:meth:`ReadAhead._route`; none at the first forward, nor for
a while once pages filled are found evicted: :class:`~bigmodel.offload.fills.Fills`).

Both calls are hints: they never change a value (a released page is read again from its file
on the next access), and they are only made on spans of file-backed mappings (never on
anonymous memory, which MADV_PAGEOUT could swap out).  Reads run on one background thread,
releases on another (a release of hundreds of MB takes a fraction of a second of CPU time, which
on the reading thread would leave the disk idle).
Nothing is done while the offloaded bytes are in RAM already: at the start of each forward
``mincore`` is asked about the first pages of ``PROBES`` modules spread over the order (all
modules' first and last pages while reading ahead); a warm page cache then costs a few
microseconds per forward and one attribute check per module.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..core.workers import worker
from .file_spans import (  # noqa: F401 (re-exported)
    _LIBC,
    MIN_ADVICE_BYTES,
    Span,
    advice_bytes,
    file_mappings,
    file_spans,
    inner_spans,
    merged_spans,
    pieces,
    resident,
    supported,
)
from .direct import Streams
from .in_order import IN_FLIGHT_BYTES, IN_FLIGHT_MAX, MADV_WILLNEED, InOrder, in_flight_for, will_need  # noqa: F401
from .drop import drop
from .fills import Fills
from .pages import available_memory
from .spread import spread_kept

logger = logging.getLogger(__name__)

ENV = "BIGMODEL_READAHEAD"  # "0" turns reading ahead from storage off
MADV_COLD = 20
MADV_PAGEOUT = 21
WINDOW_BYTES = 512 << 20  # default bytes read ahead of the running module
PROBES = 8  # modules whose first pages are checked at the start of each forward while not reading ahead
RETAIN_FRACTION = 0.5  # of the available memory, for the prefix kept cached between forwards
STREAM_FRACTION = 0.8  # offloaded bytes above this fraction of available memory: release after use
STREAM_AHEAD = 2  # streaming: largest modules' bytes read ahead of the running module (see ReadAhead._plan)
DIRECT_ENV = "BIGMODEL_DIRECT_READS"  # "0": streaming reads go through the page cache (see offload.direct)

def _executor() -> ThreadPoolExecutor:
    return worker("bigmodel-readahead")


def _releaser() -> ThreadPoolExecutor:
    """The thread that releases used modules (a ``MADV_PAGEOUT`` of a decoder layer takes a third of a
    second: on the reading thread, the disk would sit idle meanwhile)."""
    return worker("bigmodel-release")


def release(spans: Iterable[Span]) -> None:
    """Drop the spans' clean file pages from memory (:func:`~bigmodel.offload.drop.drop`: unmapped, then
    dropped from the page cache; a span it leaves, ``MADV_PAGEOUT``, or ``MADV_COLD`` where unsupported)."""
    for address, length in drop(spans):
        if _LIBC.madvise(ctypes.c_void_p(address), length, MADV_PAGEOUT) != 0:
            _LIBC.madvise(ctypes.c_void_p(address), length, MADV_COLD)


class ReadAhead:
    """Reads the file-backed offloaded weights of the next modules ahead, in execution order.

    Args:
        read: ``read(hook) -> {name: tensor}``, the hook's offloaded values (mapped views).
        window: bytes read ahead of the running module (at least the largest module's).
        available: available memory in bytes (default: ``MemAvailable`` when reading ahead starts).
        takes_direct: ``takes_direct(hook)``, True if the hook takes a slot's views (:meth:`take_direct`)
            when its module was read directly (default: every hook).  The others (staged for an
            accelerator) read their mapped views: their modules are never read into slots too.
    """

    def __init__(self, read: Callable[[Any], dict[str, torch.Tensor]], window: int = WINDOW_BYTES,
                 available: int | None = None, takes_direct: Callable[[Any], bool] | None = None) -> None:
        self.read = read
        self.takes_direct = takes_direct
        self.window = window
        self.stream_ahead = STREAM_AHEAD
        self._reach = window  # bytes read ahead of the running module in this plan (see _plan)
        self.available = available
        self.active = False  # reading ahead (the weights were found not resident at a forward's start)
        self.streaming = False  # releasing used modules (the offloaded bytes exceed the page cache)
        self._spans: list[list[Span]] | None = None
        self._drops: list[list[Span]] = []  # per order position: the pages a release drops (see inner_spans)
        self._bytes: list[int] = []
        self._kept: list[bool] = []  # per order position: never released while streaming
        self._cost: list[int] = []  # per order position: bytes it adds to what is read ahead (0: kept in RAM)
        self._next = 0  # streaming: positions < _next of the next pass are read already (wrapping around)
        self._releasing: dict[int, Future] = {}  # position -> its release in this pass
        self._used: dict[int, threading.Event] = {}  # position -> set when released (its queued reads dropped)
        self._next_used: dict[int, threading.Event] = {}  # the same for the next pass's positions read already
        self._probes: list[Span] = []  # the first span of at most PROBES modules spread over the order
        self._ahead = 0  # order positions < _ahead have been advised in this pass
        self._early = False  # this pass was begun by start(), before order[0]'s module started
        self.enabled = supported() and os.environ.get(ENV, "1").strip() != "0"
        self._lock = threading.Lock()  # forwards of one model from several threads share this state
        self._reads = InOrder()  # used on the read-ahead thread only
        self._values: list[dict[str, torch.Tensor]] = []  # the views the spans lie in (keeps their mappings)
        self._takes: list[bool] = []  # per order position: its hook takes a slot's views (see takes_direct)
        self.direct = Streams()  # streaming: released modules read with O_DIRECT into reused slots
        self._direct = False  # this plan reads released modules directly
        self._fills = Fills()  # which modules each pass reads into the page cache (see _route)
        self._ran = 0  # order positions < _ran ran in this pass (the module after them started)

    def reset(self) -> None:
        """Forget the spans (call when a weights map's values change)."""
        with self._lock:
            self._spans, self.active, self.streaming, self._early, self._values = None, False, False, False, []
            self._next_used = {}  # positions of the old order
            self.direct.reset()
            self._direct = False

    def take_direct(self, hook: Any) -> dict[str, torch.Tensor] | None:
        """``hook``'s values read directly into a slot ahead of its forward (waits for them), or None: the
        hook uses its mapped views.  Only without gradients (a slot is read into again once its module ran)."""
        if not self._direct or torch.is_grad_enabled():
            return None
        return self.direct.take(id(hook))

    def probes_resident(self) -> bool:
        """True if the first pages of the ``PROBES`` modules spread over the order are in RAM (the first
        module alone could be the last forward's staging of the next one), or nothing is read ahead."""
        probes = self._probes
        return not self.enabled or (self._spans is not None and (not probes or resident(probes, last=False)))

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
        began = (new_pass or index == 0) and not self._early  # a pass start() began goes on (reset() ends it)
        if began:
            if self._direct:  # the slots of the last pass's modules, but this pass's first ones read already
                self.direct.give_back_except({_key(order, position) for position in range(self._next)})
            self._new_pass(order)
        self._early = False
        self._ran = max(self._ran, index)
        if not self.active:
            return
        count, cost = len(order), self._cost
        previous = index - 1
        released = self.streaming and previous >= 0 and not self._kept[previous]
        direct = previous >= 0 and self._direct and self.direct.release(_key(order, previous))  # its slot is free now
        jobs: list[tuple[Callable, list[Span], object]] = []
        ahead = sum(cost[index + 1:self._ahead]) + sum(cost[:self._next])  # and the next pass's read already
        position = max(self._ahead, index)
        while position < count:
            if position > index:
                if ahead + cost[position] > self._reach:
                    break
                ahead += cost[position]
            if not self._read_direct(order, position):
                jobs.append((self._read(position), self._spans[position], self._values))  # type: ignore[index]
            position += 1
        self._ahead = max(self._ahead, position)
        if position == count and self.streaming:
            jobs += self._wrap(order, index, ahead)
        # A new pass does not wait for the last one's reads (streaming, they are this pass's first modules).
        forget = self._reads if began and not self.streaming else None
        if jobs or forget:
            _executor().submit(_run, [job for job in jobs if job[1]], forget)
        if released:
            self._used.pop(previous, threading.Event()).set()  # its reads still queued are dropped
        if released and not direct:  # a module read directly left no pages to release
            job = (functools.partial(_release, reads=self._reads), self._drops[previous], self._values)
            self._releasing[previous] = _releaser().submit(_run, [job])

    def _read(self, position: int, pass_: dict[int, threading.Event] | None = None) -> Callable:
        """The job reading ``position`` ahead in this pass (or the next: ``pass_``), dropped once it is released."""
        used = (self._used if pass_ is None else pass_).setdefault(position, threading.Event())
        return functools.partial(self._reads.read, used=used)

    def _read_direct(self, order: Sequence[Any], position: int) -> bool:
        """A module not routed through the page cache this pass (:meth:`_route`) is read directly into a
        slot where it can be (True).  Not while
        this forward records gradients: its hooks use their mapped views (:meth:`take_direct`)."""
        return (self._direct and not self._fills.cached[position] and not torch.is_grad_enabled()
                and self.direct.read(position, _key(order, position)))

    def _wrap(self, order: Sequence[Any], index: int, ahead: int) -> list[tuple[Callable, list[Span], object]]:
        """Streaming, this pass read ahead to its end: read the next pass's first released modules
        within the window (the next forward's start, the modules kept in RAM, then its first released
        module, would otherwise find the disk idle).  Only modules that ran and were released before
        ``index - 1`` (the one released now) are read again."""
        jobs = []
        while self._next < index - 1:
            size = self._cost[self._next]
            if ahead + size > self._reach:
                break
            ahead += size
            if size and not self._read_direct(order, self._next):
                read = _after(self._releasing.get(self._next), self._read(self._next, self._next_used))
                jobs.append((read, self._spans[self._next], self._values))  # type: ignore[index]
            self._next += 1
        return jobs

    def _new_pass(self, order: Sequence[Any]) -> None:
        wrapped, ran = self._next, self._ran  # the last pass read this one's first ``wrapped`` positions
        self._ahead, self._next, self._ran, self._releasing = 0, 0, 0, {}
        self._used, self._next_used = self._next_used, {}
        learned = self._spans is None or len(self._spans) != len(order)
        if learned:
            self._learn(order)
        was = self.active
        if was or learned:  # while reading ahead, or spans new: every module's (the kept ones may be the probes)
            self.active = not all(resident(spans) for spans in self._spans or [])
        else:  # a few modules spread over the order, first pages only: microseconds
            self.active = not resident(self._probes, last=False)
        if self.active and (learned or not was):
            self._plan()
        if self.active and self._direct:
            self._route([position < wrapped and self.direct.serves(_key(order, position))
                         for position in range(len(order))], ran)
        elif not self.active and self._direct:  # all in RAM: the slots' memory goes back (a cold pass plans anew)
            self.direct.close()

    def _route(self, in_slots: list[bool], ran: int) -> None:
        """With direct reads: which modules this pass reads through the page cache (:class:`Fills`; released
        ones never are).  ``in_slots``: per order position, read into a slot already (by :meth:`_wrap`);
        ``ran``: positions ``< ran`` ran in the last pass (one that raised midway ran fewer than it read ahead)."""
        now = [kept and resident(spans) for spans, kept in zip(self._spans or [], self._kept)]
        cached = self._fills.route(now, self._kept, self._bytes, in_slots, ran)
        # Streaming, the reach counts the bytes of modules not in the page cache only; otherwise all of them.
        self._cost = [0 if through and self.streaming else size for through, size in zip(cached, self._bytes)]

    def _learn(self, order: Sequence[Any]) -> None:
        self._fills.forget()
        hooks = [ref() for ref in order]
        values = [self.read(hook) if hook is not None else {} for hook in hooks]
        takes = self.takes_direct
        self._takes = [hook is not None and (takes is None or takes(hook)) for hook in hooks]
        mappings = file_mappings()  # after the reads: they map the files not mapped yet (lazily opened shards)
        self._spans = [file_spans(tensors.values(), mappings) for tensors in values]
        self._drops = [inner_spans(tensors.values(), mappings) for tensors in values]
        self._values = [tensors if spans else {} for tensors, spans in zip(values, self._spans)]  # file-backed only
        self._bytes = [sum(length for _, length in spans) for spans in self._spans]
        with_bytes = [i for i, size in enumerate(self._bytes) if size]
        self._probes = [self._spans[i][0] for i in with_bytes[:: -(-len(with_bytes) // PROBES) or 1]]  # <= PROBES modules
        self.window = max(self.window, max(self._bytes, default=0))
        self._reads.window = in_flight_for(max(self._bytes, default=0))  # an int: the reading thread sees old or new

    def _plan(self) -> None:
        available = self.available if self.available is not None else available_memory()
        total = sum(self._bytes)
        self.streaming = available > 0 and total > STREAM_FRACTION * available
        count = len(self._bytes)
        if self.streaming:
            # The last module is never released (no module starts after it in its pass): it holds the
            # place of the running one of the two windows of pages in use that the budget leaves out.
            self._kept = spread_kept(self._bytes[:-1], RETAIN_FRACTION * available - 2 * self.window) + [True]
            self._cost = [0 if kept else size for kept, size in zip(self._kept, self._bytes)]
            # Reading ``stream_ahead`` modules ahead (in the other half of the available memory) keeps the
            # disk busy while a slow module computes, and during the resident modules before the first one.
            self._reach = max(self.window, self.stream_ahead * max(self._bytes, default=0))
        else:
            self._kept, self._cost = [True] * count, list(self._bytes)
            self._reach = self.window
        largest = max(self._bytes, default=0)
        taken = [values if takes else {} for values, takes in zip(self._values, self._takes)]
        # The running module and the ones read ahead, never more than there are modules to read.
        slots = min(-(-self._reach // largest) + 1, sum(map(bool, taken))) if largest else 0
        self._direct = os.environ.get(DIRECT_ENV, "1").strip() != "0" and self.direct.plan(taken, slots, available)
        logger.debug("Reading offloaded weights ahead: %.2f GB in %d modules, %.0f MB ahead, %s",
                      total / 1e9, count, self._reach / 1e6,
                      f"releasing used modules but {sum(self._kept)} spread over the order" if self.streaming
                      else "no release")


def _key(order: Sequence[Any], position: int) -> int:
    """The key of the hook at ``position`` (its id; 0 once it is gone: nothing is read for it)."""
    hook = order[position]()
    return 0 if hook is None else id(hook)


def _release(spans: list[Span], keep: object, reads: InOrder | None = None) -> None:
    if reads is not None:
        reads.settled()  # a piece of these spans checked before ``used`` was set is asked for or touched by now
    release(spans)  # ``keep`` (the views) holds the mappings until the job has run


def _after(done: Future | None, fn: Callable) -> Callable:
    """``fn(spans, keep)`` once ``done`` (the release of the same spans, on the other thread) has run."""
    def job(spans: list[Span], keep: object) -> None:
        if done is not None:
            done.result()
        fn(spans, keep)
    return job


def _run(jobs: list[tuple[Callable, list[Span], object]], forget: InOrder | None = None) -> None:
    if forget is not None:
        forget.forget()
    for fn, spans, keep in jobs:
        fn(spans, keep)
