"""Read the weights of the next offloaded module while the current one runs.

One :class:`Prefetcher` serves all offloading hooks of a dispatched model.  When module k
starts, the weights of the next ``depth`` modules in the execution order (wrapping around,
so the first module of the next forward comes after the last one) are read on a background
thread.  During the first forward that order is a guess, the order of the modules in the
model (:mod:`bigmodel.dispatch.order`), while the order the hooks run in is recorded; the
recorded order replaces the guess from the second forward on.  At most ``depth`` modules
are staged ahead, so memory stays bounded; a module that runs out of order gets no
prefetch, and staged values it skipped over are dropped.

Staging is one function, ``stage(values, device) -> values``:

- CPU execution: the values (memory-mapped file views or RAM tensors) are used in place;
  staging touches one byte per page so that the page faults — the disk reads — happen on
  the background thread, ahead of use.  Nothing is copied.  A module whose pages are all in
  RAM already (asked with ``mincore``, on the forward thread) is not handed to the thread at
  all, and is asked about again only every ``RECHECK_EVERY`` turns; the forward never waits
  for a read ahead still running: a warm page cache costs no thread hand-offs.  While streaming,
  a module the storage read-ahead reads directly into a slot (:mod:`bigmodel.offload.direct`) is
  not touched here: :meth:`Prefetcher.take` hands its hook the slot's views.
- accelerator execution: by default a plain ``.to(device)`` on the background thread.
  :class:`bigmodel.transfer.copies.DeviceStager` (pinned staging buffer, side-stream copies) is
  the ``stage`` dispatch passes to :func:`enable_prefetch` for accelerators.  ``stage`` may
  return a dict or an object with ``wait() -> dict`` (called on the consuming thread before use).
  A stage with a ``capture(device)`` method has it called on the forward thread when a module
  is scheduled, and gets its result as a third argument (the forward thread's stream and
  device index).  A stage with ``stages_small_modules = True`` also gets the modules below
  ``min_bytes`` that lie between the ones staged ahead (the depth counts the others only).

Memory on the accelerator: the modules staged ahead never hold more bytes together than the
largest offloaded module (the room a device map keeps free is for one; depth 2 stages two
only where they fit in that).  A prefetch that runs out of device memory is dropped with a
warning and the module is read when it runs; any other error surfaces in that module's forward.

Values are never changed by staging, so outputs are bit-identical with or without prefetch.
Set ``BIGMODEL_PREFETCH_DEPTH=0`` to turn prefetching off (1 or 2 modules ahead otherwise).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..core.workers import worker
from ..offload.pages import MINCORE as _MINCORE  # noqa: F401  (tests ask whether mincore exists)
from ..offload.pages import pages_resident, touch_pages
from ..offload.quantized_store import read_offloaded
from ..offload.readahead import ReadAhead, merged_spans, resident
from .order import ExecutionOrder

logger = logging.getLogger(__name__)

DEPTH_ENV = "BIGMODEL_PREFETCH_DEPTH"
DEFAULT_DEPTH = 1
MAX_DEPTH = 2
MIN_BYTES = 1 << 20  # bytes; smaller modules are not prefetched (a thread hand-off costs more than the read)
RECHECK_EVERY = 8  # a CPU module found in RAM is asked again (``mincore``) only every this many turns
QUIET_FORWARDS = RECHECK_EVERY - 1  # forwards without prefetch work after one that found nothing to do
MAX_SMALL_AHEAD = 16  # below-threshold modules staged between two large ones (stages_small_modules)

StageFn = Callable[..., Any]

def _executor() -> ThreadPoolExecutor:
    return worker("bigmodel-prefetch")


def stage(values: dict[str, torch.Tensor], device: torch.device | None) -> dict[str, torch.Tensor]:
    """Default staging: fault CPU pages in (no copy), or copy to an accelerator.

    Args:
        values: name → value read from the weights map.
        device: the execution device (None or cpu: values are used in place).

    Returns:
        name → value ready for the hook (same tensors on CPU).
    """
    if device is None or device.type == "cpu":
        for tensor in values.values():
            touch_pages(tensor)
        return values
    return {name: tensor.to(device, non_blocking=True) for name, tensor in values.items()}


class Prefetcher:
    """Reads the weights of the next offloaded modules ahead, in execution order (guessed, then recorded).

    With the default staging function, a CPU-executed module costs nothing when its pages are
    already in RAM (checked with ``mincore`` on the forward thread, no thread hand-off), and the
    forward never waits for a read ahead that is still running (the values are the same views
    either way; the page faults then happen on whichever thread touches a page first).

    Args:
        depth: how many modules ahead to stage (1 or 2).
        stage: the staging function (see the module docstring).
        min_bytes: modules with fewer offloaded bytes are read when they run, not ahead.
        order: the hooks in their expected execution order, followed during the first forward
            (empty: nothing is read ahead until the first forward's order has been recorded).
    """

    def __init__(self, depth: int = DEFAULT_DEPTH, stage: StageFn = stage, min_bytes: int = MIN_BYTES,
                 order: Iterable[Any] = ()) -> None:
        self.depth = depth
        self.stage = stage
        self.min_bytes = min_bytes
        self.in_place = stage is globals()["stage"]  # CPU values are used as they are: staging only faults pages
        self.stages_small = bool(getattr(stage, "stages_small_modules", False)) and not self.in_place
        self._capture = getattr(stage, "capture", None)
        self._warned_memory = False
        self.order = ExecutionOrder(order)
        self._pending: dict[int, Future] = {}
        self._trusted: dict[int, int] = {}  # id(hook) → turns left before its residency is asked again
        self._probes: dict[int, list] = {}  # id(hook) → spans of its values (found in RAM), asked without reading them
        self._steady: dict[int, list[int]] = {}  # index → ids of the CPU hooks ahead of it, read in place
        self.read_lock = threading.Lock()  # weights-map reads are serialised (loaders are not thread-safe)
        # Storage reads ahead of the page faults (file-backed values); CPU hooks using their values in place
        # take slots' views where modules are read directly (take), no other hook does.
        self.readahead = ReadAhead(_weak_read(self), takes_direct=functools.partial(_takes_direct, self.in_place))
        self.quiet = False  # this forward has nothing to stage or read ahead: the hooks skip take and schedule_after
        self._quiet_left = 0  # quiet forwards to come
        self._calm = False  # this (checked) forward has found nothing to do so far

    def __deepcopy__(self, memo: dict) -> Prefetcher:
        """A fresh prefetcher with the same settings (a copied model learns its own order; nothing staged)."""
        return Prefetcher(self.depth, copy.deepcopy(self.stage, memo), self.min_bytes)

    @property
    def recording(self) -> bool:
        """True during the first forward (its execution order is being recorded)."""
        return self.order.recording

    @property
    def order_length(self) -> int:
        """Number of hooks in the recorded execution order (so far, during the first forward)."""
        return self.order.recorded_length

    @property
    def pending(self) -> int:
        """Number of modules staged or being staged now."""
        return len(self._pending)

    def read(self, hook: Any) -> dict[str, torch.Tensor]:
        """The values the hook puts in at its forward, from the weights maps (serialised with the background reads)."""
        with self.read_lock:
            read_values = getattr(hook, "read_values", None)
            if read_values is not None:
                return read_values()
            return read_offloaded(hook.weights_map, hook.offloaded_names)

    def take(self, hook: Any, read: bool = True) -> Mapping[str, torch.Tensor] | None:
        """The hook's values: the staged ones if a prefetch was started, else read now.

        With ``read=False``: None where the values are used in place (CPU execution, default
        staging), where the hook reading them itself gets the same views; what was staged for it is
        dropped.
        """
        future = self._pending.pop(id(hook), None)
        if future is not None:
            self._calm = False
        direct = self.readahead.take_direct(hook) if self.in_place and _on_cpu(hook.device) else None
        if direct is not None:  # read from storage into a slot (streaming, offload.direct)
            return direct
        if not read and self.in_place and _on_cpu(hook.device):
            return None
        if future is not None and not (self.in_place and not future.done() and _on_cpu(hook.device)):
            result = future.result()
            if result is not None:
                return result.wait() if hasattr(result, "wait") else result
        return self.read(hook)

    def schedule_after(self, hook: Any) -> None:
        """Called when ``hook``'s module starts: stage the next modules in the execution order
        (the guessed one during the first forward, which records the actual one)."""
        order = self.order
        if not order.recording and not self._pending and not self.readahead.active:
            index = order.position.get(id(hook))
            if index and self._countdown(self._steady.get(index)):
                return  # every module ahead is in RAM and trusted to stay (decode steps of a warm cache)
        first = order.at_start
        changed = order.observe(hook)
        if changed:
            self._order_recorded()
        index = order.position.get(id(hook))
        if index is None or self.depth <= 0:
            return
        readahead = self.readahead
        if readahead.active or index == 0 or first or changed:  # otherwise it has nothing to do (no lock taken)
            readahead.advance(order.refs, index, new_pass=first or changed)
        ahead = self._ahead(index)
        if self._pending:
            ahead_keys = {id(order.refs[j]()) for j in ahead}
            for stale in [k for k in self._pending if k not in ahead_keys]:
                self._pending.pop(stale).cancel()
        staged, largest, in_place = None, order.largest, []
        for j in ahead:
            target = order.refs[j]()
            if target is None or id(target) in self._pending:
                continue
            if self.in_place and _on_cpu(target.device):
                if self.readahead.direct.serves(id(target)):
                    continue  # read into a slot: touching its mapped views would read it twice
                self._read_ahead_in_place(target)
                in_place.append(id(target))
                continue
            if staged is None:  # bytes of the modules staged ahead now
                staged = sum(b for b in (order.sizes[order.position[k]] for k in self._pending) if b >= self.min_bytes)
            if order.sizes[j] >= self.min_bytes:
                if staged + order.sizes[j] > largest:
                    break  # the modules staged ahead hold at most the largest module's bytes
                staged += order.sizes[j]
            context = self._capture(target.device) if self._capture is not None else None
            self._pending[id(target)] = _executor().submit(self._fetch, order.refs[j], context)
        if not order.recording and len(in_place) == len(ahead):
            self._steady[index] = in_place
        if self._pending:
            self._calm = False

    def _order_recorded(self) -> None:
        """The recorded order replaces the guess: the read-ahead spans are learned again along it."""
        self.readahead.reset()
        self._steady.clear()
        self._calm = False

    def forward_starts(self) -> None:
        """The model's own forward starts (its root hook): the storage read-ahead of the first offloaded
        modules begins now rather than when the first of them starts (along the guessed order at the
        first forward, the recorded one from the second on: its start ends the recording).

        A forward that found nothing to stage or read ahead (CPU values used in place, all in RAM) is
        followed by ``QUIET_FORWARDS`` *quiet* ones (:attr:`quiet`): the hooks neither take nor schedule
        (the Python work of a warm decode step), while the first pages of a few offloaded modules spread
        over the order stay in RAM (:meth:`~bigmodel.offload.readahead.ReadAhead.probes_resident`, at each
        start); then a forward checks everything again.
        """
        order, readahead = self.order, self.readahead
        if order.finish():  # the second forward: read ahead along the recorded order from its start
            self._order_recorded()
        if self._calm and not self._pending and not readahead.active:
            self._quiet_left = QUIET_FORWARDS
        self._calm = False
        if self._quiet_left > 0 and not self._pending and not readahead.active and readahead.probes_resident():
            self._quiet_left -= 1
            self.quiet = True
            return
        if self.quiet:  # the quiet forwards end: each module in RAM is asked again now (none was for a while)
            self._trusted.clear()
        self.quiet, self._quiet_left = False, 0
        if order.refs and (not order.recording or order.at_start):
            readahead.start(order.refs)
        self._calm = self.in_place and not order.recording and not readahead.active and all(
            hook is not None and _on_cpu(hook.device) for hook in (ref() for ref in order.refs))

    def forward_failed(self) -> None:
        """The model's own forward raised: a first forward's partial order is not kept (the next forward
        records it again along the guess, :meth:`ExecutionOrder.restart`)."""
        self.order.restart()

    def _countdown(self, keys: list[int] | None) -> bool:
        """One more turn for each of the modules ``keys`` (found in RAM) without asking the kernel: what
        :meth:`_read_ahead_in_place` does for them; False (nothing counted) when one is due to be asked."""
        if keys is None:
            return False
        trusted = self._trusted
        for key in keys:
            if trusted.get(key, 0) <= 0:
                return False
        for key in keys:
            trusted[key] -= 1
        return True

    def _ahead(self, index: int) -> list[int]:
        """Positions to stage after ``index``: the next ``depth`` modules of at least ``min_bytes``
        (wrapping around), with the smaller ones between them when the stage takes those too."""
        sizes = self.order.sizes
        count = len(sizes)
        if not self.stages_small:
            steps = range(1, min(self.depth, count - 1) + 1)
            return [j for j in ((index + step) % count for step in steps) if sizes[j] >= self.min_bytes]
        ahead, large, small = [], 0, 0
        for step in range(1, count):
            j = (index + step) % count
            if sizes[j] >= self.min_bytes:
                ahead.append(j)
                large += 1
                if large == self.depth:
                    break
            elif small < MAX_SMALL_AHEAD:
                ahead.append(j)
                small += 1
        return ahead

    def _read_ahead_in_place(self, target: Any) -> None:
        """Fault ``target``'s pages in on the background thread unless they are in RAM already.

        A module found resident is trusted to stay so for its next ``RECHECK_EVERY - 1`` turns
        (no ``mincore`` calls, no reads): its own forward then reads its values when it runs.  Then
        the spans of its values (merged: a few ``mincore`` calls, no weights-map reads) are asked
        again, and only if some page is out are its values read and asked about one by one.
        Residency only decides whether to read ahead, never which values are used.
        """
        key = id(target)
        turns = self._trusted.get(key, 0)
        if turns > 0:
            self._trusted[key] = turns - 1
            return
        probe = self._probes.get(key)
        if probe and resident(probe):
            self._trusted[key] = RECHECK_EVERY - 1
            return
        values = self.read(target)
        if all(pages_resident(value) for value in values.values()):
            self._trusted[key] = RECHECK_EVERY - 1  # in RAM: no thread hand-off, nothing to touch
            self._probes[key] = merged_spans(values.values())
        else:
            self._pending[key] = _executor().submit(self.stage, values, target.device)

    def _fetch(self, ref: weakref.ref, context: Any = None) -> Any:
        hook = ref()
        if hook is None:
            return None
        values = self.read(hook)
        try:
            if context is None:
                return self.stage(values, hook.device)
            return self.stage(values, hook.device, context)
        except torch.OutOfMemoryError as error:  # a prefetch is an optimisation: read the module when it runs
            self._out_of_memory(hook, error)
            return None

    def _out_of_memory(self, hook: Any, error: BaseException) -> None:
        log = logger.debug if self._warned_memory else logger.warning
        self._warned_memory = True
        log(
            "Out of device memory while prefetching %r (%d bytes); it is read when it runs instead. "
            "Leave more room on the execution device (max_memory) or set %s=0 to stop prefetching. (%s)",
            getattr(hook, "module_name", "") or type(hook).__name__, getattr(hook, "staged_bytes", 0),
            DEPTH_ENV, str(error).splitlines()[0] if str(error) else type(error).__name__,
        )

    def invalidate(self) -> None:
        """Drop everything staged (call when a weights map's values change)."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self.quiet, self._quiet_left, self._calm = False, 0, False
        self._trusted.clear()
        self._probes.clear()
        self._steady.clear()
        self.readahead.reset()


def _weak_read(prefetcher: Prefetcher) -> Callable[[Any], dict[str, torch.Tensor]]:
    """``prefetcher.read`` without a reference to it: its read-ahead, which keeps the views it reads, is
    then in no reference cycle, and a deleted model's weights are freed at once."""
    ref = weakref.ref(prefetcher)

    def read(hook: Any) -> dict[str, torch.Tensor]:
        owner = ref()
        return {} if owner is None else owner.read(hook)

    return read


def _on_cpu(device: torch.device | None) -> bool:
    return device is None or device.type == "cpu"


def _takes_direct(in_place: bool, hook: Any) -> bool:
    """True if :meth:`Prefetcher.take` gives ``hook`` a slot's views where its module was read directly."""
    return in_place and _on_cpu(hook.device)
