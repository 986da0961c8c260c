"""Which offloaded modules a forward with direct reads reads into the page cache (the rest go into slots).

Reading a module through the page cache costs the kernel a fresh page per 4 KB (on the 2-core development
VM ~1.3 s of CPU time per GB, which the forward waits for), but a module in the page cache is read no more.
:class:`Fills` decides, pass by pass, which of the modules that may stay in RAM (the kept ones while
streaming, every one otherwise) are read through it: those in RAM already, and up to ``POPULATE_FRACTION``
of their bytes more per pass; none at the first pass, and none for a while once what a pass filled is found
evicted at the next one (memory pressure, or another program dropping it, takes it before it is used again).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

POPULATE_FRACTION = 1 / 3  # of the kept modules' bytes: read into the page cache per pass, at most
FILL_HOLD = 4  # passes that fill no page cache once pages a pass read into it are found evicted (doubling each time)
FILL_HOLD_MAX = 64  # the longest such hold, in passes


class Fills:
    """The page-cache fills of one :class:`~bigmodel.offload.readahead.ReadAhead`, pass by pass."""

    def __init__(self) -> None:
        self.cached: list[bool] = []  # per order position, this pass: read through the page cache
        self.passes = 0  # passes routed (never reset: the first one fills no page cache)
        self.filled = False  # the last pass read modules into the page cache
        self.hold = 0  # passes left that fill no page cache (its pages were evicted)
        self.backoff = 0  # the length of the last hold, in passes

    def forget(self) -> None:
        """A new order: the last one's positions hold no evictions to find."""
        self.cached = []

    def route(self, now: list[bool], kept: list[bool], sizes: list[int], in_slots: list[bool], ran: int) -> list[bool]:
        """Per order position, True if this pass reads the module through the page cache.

        Args:
            now: its pages are in RAM at this pass's start (False for a released module).
            kept: it may stay in RAM between passes (never released).
            sizes: its bytes.
            in_slots: read into a slot already (by the last pass's end): never through the page cache.
            ran: positions ``< ran`` ran in the last pass (one that raised midway ran fewer).

        A kept module in RAM is read through the page cache; one not in RAM is while this pass's budget
        lasts: none at the first pass, none while a hold lasts (:meth:`_may_fill`), else
        ``POPULATE_FRACTION`` of the kept bytes (decoding, that CPU time overlaps the other modules' reads);
        a model that fits in memory is all in the page cache after four passes."""
        fill = self._may_fill(now, ran) and self.passes > 0
        budget = POPULATE_FRACTION * sum(size for size, k in zip(sizes, kept) if k) if fill else 0
        self.passes += 1
        cached, filled = [], False
        for through, keep, size, slotted in zip(now, kept, sizes, in_slots):
            if slotted:
                through = False
            elif keep and not through and size <= budget:
                through, budget, filled = True, budget - size, True
            cached.append(through)
        self.cached, self.filled = cached, filled
        return cached

    def _may_fill(self, now: list[bool], ran: int) -> bool:
        """True if this pass may read modules into the page cache.

        A module the last pass read through the page cache (and ran) whose pages are gone now was evicted;
        each GB filled costs CPU time the forward waits for.  Then the next ``FILL_HOLD`` passes fill nothing,
        and a hold that follows another right away lasts twice as long, up to ``FILL_HOLD_MAX`` passes; a
        pass whose fills are all found in RAM ends the doubling."""
        last = self.cached if len(self.cached) == len(now) else []
        if any(through and not now[i] for i, through in enumerate(last[:ran])):
            self.backoff = min(max(FILL_HOLD, 2 * self.backoff), FILL_HOLD_MAX)
            self.hold = self.backoff
            logger.debug("Offloaded pages read into the page cache were evicted: none filled for %d passes", self.hold)
        elif self.filled:
            self.backoff = 0
        fill = self.hold == 0
        self.hold = max(0, self.hold - 1)
        return fill
