"""A simulated accelerator for CPU tests of the transfer path (streams, events, pinned memory, staging ring).

The CPU plays the accelerator: bigmodel's transfer layer is told that ``cpu`` is the accelerator
type, so side-stream copies, events, the pinned staging ring and the prefetch worker all run.
What makes it more than a call logger: **copies issued on a side stream are deferred**.  A copy
returns an empty tensor and is queued on its stream; it runs only when something orders it (an
event it precedes is synchronized, or a stream waits on such an event).  So a host buffer reused
before its copy has run, or a value read before the consumer waited for its copy, gives wrong
numbers here, as it would on a GPU under load.

- The current stream is per thread, as on real backends: the thread that installed the fake runs
  on stream ``compute``; any other thread (the prefetch worker) sees its own ``default-<name>``.
- "Pinned" memory is ordinary memory whose allocations are remembered; ``Tensor.is_pinned`` is
  answered from them; weak references to them tell when they are freed, and each trim of the host
  allocator's cache (``empty_host_cache``) records which were freed by then.
- ``fail_next_copy(error)`` makes the next side-stream copy raise (a CUDA OOM on the copy stream).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bigmodel.dispatch import dispatch as dispatch_module
from bigmodel.dispatch import redispatch as redispatch_module
from bigmodel.dispatch import whole_model as whole_model_module
from bigmodel.transfer import copies as copies_module
from bigmodel.transfer import pinned as pinned_module


class FakeStream:
    """A stream: an ordered queue of deferred copies."""

    def __init__(self, backend: FakeAccelerator, name: str) -> None:
        self.backend, self.name = backend, name
        self.ops: list[Callable[[], None]] = []
        self.done = 0
        self._lock = threading.Lock()
        self._saved: list = []

    def run(self, upto: int | None = None) -> None:
        """Run the queued copies up to position ``upto`` (all of them by default)."""
        with self._lock:  # the forward thread and the prefetch thread may both wait on this stream
            upto = len(self.ops) if upto is None else upto
            while self.done < upto:
                op, self.ops[self.done] = self.ops[self.done], None  # a copy holds its source only until it runs
                op()
                self.done += 1

    def __enter__(self) -> FakeStream:
        self.backend.log.append(("enter", self.name, threading.current_thread().name))
        self._saved.append(self.backend.current())
        self.backend._local.stream = self
        return self

    def __exit__(self, *exc) -> None:
        self.backend._local.stream = self._saved.pop()
        self.backend.log.append(("exit", self.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.backend.log.append(("wait_event", self.name, event.name))
        event.synchronize()  # the consumer's later work (run at once on the host here) comes after the copy

    def wait_stream(self, other: FakeStream) -> None:
        self.backend.log.append(("wait_stream", self.name, other.name))
        other.run()


class FakeEvent:
    def __init__(self, backend: FakeAccelerator) -> None:
        backend.events += 1
        self.backend, self.name = backend, f"event{backend.events}"
        self.stream: FakeStream | None = None
        self.mark = 0

    def record(self, stream: FakeStream) -> None:
        self.stream, self.mark = stream, len(stream.ops)
        self.backend.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.mark

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run(self.mark)


@dataclass
class FakeAccelerator:
    log: list = field(default_factory=list)
    events: int = 0
    streams: list = field(default_factory=list)
    pinned: list = field(default_factory=list)  # (data_ptr, nbytes) of fake pinned allocations
    arena_refs: list = field(default_factory=list)  # weak references to their storages
    trims: list = field(default_factory=list)  # per host-cache trim: which arenas were freed by then
    copies: int = 0
    record_stream_calls: list = field(default_factory=list)
    _fail: list = field(default_factory=list)
    _local: threading.local = field(default_factory=threading.local)
    forward_thread: threading.Thread = field(default_factory=threading.current_thread)
    compute: FakeStream | None = None
    on_pin: Callable[[int], None] | None = None  # called before each pinned allocation (bytes), may raise

    def current(self) -> FakeStream:
        stream = getattr(self._local, "stream", None)
        if stream is None:
            if threading.current_thread() is self.forward_thread:
                stream = self.compute
            else:
                stream = FakeStream(self, f"default-{threading.current_thread().name}")
            self._local.stream = stream
        return stream

    def fail_next_copy(self, error: BaseException) -> None:
        self._fail.append(error)

    def new_stream(self, device) -> FakeStream:
        stream = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(stream)
        return stream

    def device_copy(self, tensor: torch.Tensor, target: torch.device) -> torch.Tensor:
        if self._fail:
            raise self._fail.pop(0)
        self.copies += 1
        stream = self.current()
        out = torch.empty_like(tensor, device=target, memory_format=torch.contiguous_format)
        if stream.name.startswith("side"):
            stream.ops.append(lambda: out.copy_(tensor))  # runs when ordered, reading the source then
        else:
            out.copy_(tensor)
        return out

    def pinned_arena(self, nbytes: int) -> torch.Tensor:
        if self.on_pin is not None:
            self.on_pin(nbytes)
        arena = torch.empty(nbytes, dtype=torch.uint8)
        self.pinned.append((arena.data_ptr(), nbytes))
        self.arena_refs.append(StorageWeakRef(arena.untyped_storage()))
        return arena

    def live_arenas(self) -> int:
        """Bytes of fake pinned allocations still alive."""
        return sum(size for (_, size), ref in zip(self.pinned, self.arena_refs) if not ref.expired())

    def trim(self) -> None:
        self.trims.append([ref.expired() for ref in self.arena_refs])

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        pointer = tensor.data_ptr()
        return any(start <= pointer < start + size for start, size in self.pinned)

    def drain(self) -> None:
        """Run every queued copy (the device catching up)."""
        for stream in self.streams:
            stream.run()


def install(monkeypatch: pytest.MonkeyPatch) -> FakeAccelerator:
    """Make bigmodel's transfer layer treat ``cpu`` as an accelerator with the simulated streams above.

    bigmodel's background workers are drained first: a read-ahead still queued by an earlier test's model
    would otherwise run on the fake and could take a failure injected with ``fail_next_copy``."""
    drain_workers()
    fake = FakeAccelerator()
    fake.compute = FakeStream(fake, "compute")
    fake._local.stream = fake.compute
    for module in (copies_module, pinned_module):
        monkeypatch.setattr(module, "accelerator_type", lambda: "cpu")
    monkeypatch.setattr(copies_module, "_new_stream", fake.new_stream)
    monkeypatch.setattr(copies_module, "_current_stream", lambda device: fake.current())
    monkeypatch.setattr(copies_module, "_new_event", lambda device: FakeEvent(fake))
    monkeypatch.setattr(copies_module, "_record_stream",
                        lambda tensor, stream: fake.record_stream_calls.append(stream.name) or True)
    monkeypatch.setattr(copies_module, "_is_device_source", lambda tensor, target: False)  # cpu sources are host memory
    monkeypatch.setattr(copies_module, "_device_copy", fake.device_copy)
    monkeypatch.setattr(copies_module, "_current_index", lambda device_type: 0)
    monkeypatch.setattr(pinned_module, "_pinned_arena", fake.pinned_arena)
    monkeypatch.setattr(pinned_module, "_empty_host_cache", fake.trim)
    real_is_pinned = torch.Tensor.is_pinned
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self, *a, **k: fake.is_pinned(self) or real_is_pinned(self, *a, **k))

    def no_device_sync(*args, **kwargs):
        raise AssertionError("a device-wide synchronize was called")

    monkeypatch.setattr(torch.accelerator, "synchronize", no_device_sync)
    return fake


def drain_workers(timeout_s: float = 60.0) -> None:
    """Wait until every task queued so far on bigmodel's one-thread background workers (prefetch,
    storage read-ahead, its releases, resident read) has run: each runs its queue in order."""
    from bigmodel.core.workers import worker

    for name in ("bigmodel-prefetch", "bigmodel-release", "bigmodel-readahead", "bigmodel-resident"):
        worker(name).submit(lambda: None).result(timeout=timeout_s)



def dispatch_as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make dispatch/cpu_offload/disk_offload treat a ``cpu`` execution device as an accelerator
    (CPU weights pinned, offloaded modules staged by DeviceStager); use with :func:`install`."""
    for module in (dispatch_module, whole_model_module, redispatch_module):
        monkeypatch.setattr(module, "_runs_on_accelerator", lambda device: device is not None and device != "disk")
