"""CPU tests of bigmodel.transfer.pinned and bigmodel.transfer.copies: pinning policy, staging ring, copy semantics
and stream ordering.

The stream path is exercised with fake streams/events (monkeypatched backend functions) that record
the calls, so the ordering logic (event after copies, consumer waits on the event, record_stream on
the consumer stream, no device-wide sync) is checked here; real streams run in test_accelerator.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from bigmodel.core import devices as _devices
from bigmodel.transfer import copies as _transfer
from bigmodel.transfer import pinned as _pinned
from bigmodel.transfer.copies import CopyStream, DeviceStager, PendingCopy
from bigmodel.transfer.pinned import (
    PINNED_ARENA_BYTES,
    _plan_arenas,
    pin_memory_enabled,
    pin_tensors,
)
from bigmodel.transfer.staging import StagingBuffer

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.bool]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8) if tensor.dtype != torch.bool else tensor


def _sample(dtype: torch.dtype, shape=(3, 5)) -> torch.Tensor:
    return torch.randn(shape).mul(8).to(dtype)


# ----------------------------------------------------------------------------- pinning


@pytest.fixture
def cpu_only(monkeypatch):
    """Behave as on a machine without an accelerator, also where one exists."""
    monkeypatch.setattr(_pinned, "accelerator_type", lambda: None)
    monkeypatch.setattr(_transfer, "accelerator_type", lambda: None)
    monkeypatch.setattr(_devices, "accelerator_type", lambda: None)


def test_pin_tensors_is_identity_without_accelerator(cpu_only):
    tensors = {"a": torch.randn(4), "b": torch.zeros(2, dtype=torch.bfloat16)}
    out = pin_tensors(tensors, enabled=True)
    assert out is not tensors
    assert out["a"] is tensors["a"] and out["b"] is tensors["b"]
    assert not out["a"].is_pinned()


@pytest.mark.parametrize(
    ("env", "enabled", "expected"),
    [(None, True, True), ("0", True, False), ("off", True, False), ("1", False, False), ("yes", True, True)],
)
def test_pin_memory_enabled_follows_argument_env_and_accelerator(monkeypatch, env, enabled, expected):
    monkeypatch.setattr(_pinned, "accelerator_type", lambda: "cuda")
    if env is None:
        monkeypatch.delenv("BIGMODEL_PIN_MEMORY", raising=False)
    else:
        monkeypatch.setenv("BIGMODEL_PIN_MEMORY", env)
    assert pin_memory_enabled(enabled) is expected


def test_pin_memory_enabled_false_on_cpu_only_machine(monkeypatch):
    monkeypatch.delenv("BIGMODEL_PIN_MEMORY", raising=False)
    monkeypatch.setattr(_pinned, "accelerator_type", lambda: None)
    assert pin_memory_enabled(True) is False


def test_pin_memory_env_rejects_unknown_value(monkeypatch):
    monkeypatch.setenv("BIGMODEL_PIN_MEMORY", "maybe")
    with pytest.raises(ValueError, match="BIGMODEL_PIN_MEMORY='maybe'.*set it to 0"):
        pin_tensors({"a": torch.zeros(1)})


def test_pin_tensors_packs_into_arenas_and_keeps_values_dtypes_and_ties(monkeypatch):
    """With pinning forced on (arenas allocated unpinned here), values, dtypes, shapes and ties survive."""
    monkeypatch.setattr(_pinned, "pin_memory_enabled", lambda enabled=True: enabled)
    allocated = []
    monkeypatch.setattr(_pinned, "_pinned_arena", lambda n: allocated.append(n) or torch.empty(n, dtype=torch.uint8))
    tensors = {str(dtype): _sample(dtype) for dtype in DTYPES}
    tensors["tied"] = tensors[str(torch.float32)]
    tensors["strided"] = torch.arange(12.0).view(3, 4).t()
    tensors["scalar"] = torch.tensor(7.0, dtype=torch.float64)
    out = pin_tensors(tensors)
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and out[name].shape == tensor.shape, name
        assert torch.equal(_bits(out[name]), _bits(tensor)), name
        assert out[name].is_contiguous()
    assert out["tied"] is out[str(torch.float32)]
    assert len(allocated) == 1 and allocated[0] <= PINNED_ARENA_BYTES  # one shared arena, not one per tensor
    assert allocated[0] & (allocated[0] - 1) == 0  # a power of two: nothing left for the allocator to round


def test_pin_tensors_leaves_non_cpu_and_empty_tensors(monkeypatch):
    monkeypatch.setattr(_pinned, "pin_memory_enabled", lambda enabled=True: True)
    monkeypatch.setattr(_pinned, "_pinned_arena", lambda n: torch.empty(n, dtype=torch.uint8))
    meta, empty = torch.empty(3, device="meta"), torch.empty(0)
    out = pin_tensors({"meta": meta, "empty": empty})
    assert out["meta"] is meta and out["empty"] is empty


def test_pin_tensors_falls_back_when_pinning_fails(monkeypatch, caplog):
    monkeypatch.setattr(_pinned, "pin_memory_enabled", lambda enabled=True: True)

    def refuse(nbytes):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(_pinned, "_pinned_arena", refuse)
    tensors = {"a": torch.ones(3)}
    with caplog.at_level("WARNING", logger="bigmodel.transfer.pinned"):
        out = pin_tensors(tensors)
    assert out["a"] is tensors["a"]
    assert "BIGMODEL_PIN_MEMORY=0" in caplog.text


def test_plan_arenas_first_fit_power_of_two():
    mib = 2**20
    sizes, places = _plan_arenas([300 * mib, 100 * mib, 8 * mib, 200 * mib], 256 * mib)
    # 300 MiB opens a 512 MiB arena that also takes 100 and 8 MiB; 200 MiB no longer fits there.
    assert places == [(0, 0), (0, 300 * mib), (0, 400 * mib), (1, 0)]
    assert sizes == [512 * mib, 256 * mib]
    assert _plan_arenas([], 256 * mib) == ([], [])


# ----------------------------------------------------------------------------- staging buffer


def test_staging_copies_bits_into_reused_buffer_memory(cpu_only):
    buffer = StagingBuffer(4096, alignment=64)
    assert not buffer.pinned  # no accelerator here
    base = buffer.buffer.data_ptr()
    tensors = {str(dtype): _sample(dtype, (4, 4)) for dtype in DTYPES}
    batch = buffer.stage(tensors)
    for name, tensor in tensors.items():
        staged = batch.tensors[name]
        assert staged.dtype == tensor.dtype and staged.shape == tensor.shape
        assert torch.equal(_bits(staged), _bits(tensor))
        assert base <= staged.data_ptr() < base + 4096  # a view of the one buffer
        assert (staged.data_ptr() - base) % 64 == 0
    assert buffer.used == batch.nbytes == 6 * 64
    batch.release()
    assert buffer.used == 0
    again = buffer.stage({"x": torch.ones(8)})
    assert again.start == 0 and again.tensors["x"].data_ptr() == base  # empty ring restarts, same memory
    assert buffer.buffer.data_ptr() == base


def test_staging_ring_wraps_and_blocks_until_release():
    buffer = StagingBuffer(1024, alignment=64)
    chunk = {"w": torch.zeros(96)}  # 384 bytes -> 384 aligned
    first, second = buffer.stage(chunk), buffer.stage(chunk)
    assert (first.start, second.start) == (0, 384)
    with pytest.raises(TimeoutError, match="staging buffer.*StagedBatch.release"):
        buffer.stage(chunk, timeout=0.05)  # 256 bytes left at the end, none at the start
    first.release()
    third = buffer.stage(chunk, timeout=1)
    assert third.start == 0  # wrapped into the freed front
    result = {}

    def reader():
        result["batch"] = buffer.stage({"w": torch.full((96,), 3.0)}, timeout=5)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(0.1)
    assert thread.is_alive()  # full: the reader waits
    second.release()
    thread.join(5)
    assert result["batch"].start == 384 and torch.equal(result["batch"].tensors["w"], torch.full((96,), 3.0))


class _FakeFence:
    def __init__(self):
        self.done = False
        self.synchronized = 0

    def query(self):
        return self.done

    def synchronize(self):
        self.synchronized += 1
        self.done = True


def test_staging_release_after_copy_waits_for_that_copy_only():
    buffer = StagingBuffer(512, alignment=64)
    batch = buffer.stage({"w": torch.zeros(128)})  # 512 bytes: full
    fence = _FakeFence()
    batch.release(after=PendingCopy({}, torch.device("cpu"), event=fence))
    assert buffer.used == 512  # not reclaimed while the copy may still read it
    nxt = buffer.stage({"w": torch.ones(4)}, timeout=1)
    assert fence.synchronized == 1 and nxt.start == 0


def test_staging_failed_read_frees_its_region():
    buffer = StagingBuffer(1024, alignment=64)

    class Unreadable(torch.Tensor):
        pass

    bad = torch.zeros(4).as_subclass(Unreadable)
    original = torch.Tensor.copy_

    def copy_(self, source, *args, **kwargs):
        if isinstance(source, Unreadable):
            raise OSError("read error on the offload folder")
        return original(self, source, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "copy_", copy_)
        with pytest.raises(OSError, match="read error"):
            buffer.stage({"w": bad})
    assert buffer.used == 0


def test_staging_dedupes_tied_tensors():
    buffer = StagingBuffer(1024, alignment=64)
    shared = torch.randn(8)
    batch = buffer.stage({"a": shared, "b": shared})
    assert batch.tensors["a"] is batch.tensors["b"] and batch.nbytes == 64


def test_staging_errors_name_the_problem_and_fix():
    with pytest.raises(ValueError, match="positive capacity.*'1GiB'"):
        StagingBuffer(0)
    buffer = StagingBuffer("1KiB")
    assert buffer.capacity == 1024
    with pytest.raises(ValueError, match="'big'.*more than the staging buffer's 1024.*at least the largest"):
        buffer.stage({"big": torch.zeros(1024)})
    with pytest.raises(ValueError, match="Cannot stage 'm'.*meta.*CopyStream.copy"):
        buffer.stage({"m": torch.empty(2, device="meta")})
    batch = buffer.stage({"w": torch.zeros(2)})
    batch.release()
    with pytest.raises(RuntimeError, match="already released"):
        batch.release()


# ----------------------------------------------------------------------------- copies on CPU


def test_copy_to_cpu_is_synchronous_and_copy_free():
    stream = CopyStream("cpu")
    assert stream.stream is None
    tensors = {str(dtype): _sample(dtype) for dtype in DTYPES}
    pending = stream.copy(tensors, "cpu")
    assert pending.ready() and pending.event is None
    out = pending.wait()
    for name, tensor in tensors.items():
        assert out[name] is tensor  # already on the device: no copy, dtype untouched


def test_copy_to_meta_keeps_dtype_and_shape():
    out = CopyStream("cpu").copy({"w": torch.zeros(2, 3, dtype=torch.float8_e5m2)}, "meta").wait()
    assert out["w"].device.type == "meta" and out["w"].dtype == torch.float8_e5m2 and out["w"].shape == (2, 3)


def test_copy_rejects_meta_sources_and_disk(cpu_only):
    with pytest.raises(ValueError, match="Cannot copy 'layer.weight'.*meta.*weights map"):
        CopyStream("cpu").copy({"layer.weight": torch.empty(2, device="meta")})
    with pytest.raises(ValueError, match="'disk' is not a torch device"):
        CopyStream("disk")
    with pytest.raises(ValueError, match="torch sees none"):
        CopyStream(0)


# ----------------------------------------------------------------------------- stream logic (fakes)


class _Recorder:
    def __init__(self):
        self.calls = []


class _FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def __enter__(self):
        self.log.calls.append(("enter", self.name))
        return self

    def __exit__(self, *exc):
        self.log.calls.append(("exit", self.name))

    def wait_event(self, event):
        self.log.calls.append(("wait_event", self.name, event.name))

    def wait_stream(self, other):
        self.log.calls.append(("wait_stream", self.name, other.name))


class _FakeEvent:
    count = 0

    def __init__(self, log):
        _FakeEvent.count += 1
        self.log, self.name, self.done = log, f"event{_FakeEvent.count}", False

    def record(self, stream):
        self.log.calls.append(("record", self.name, stream.name))

    def query(self):
        return self.done

    def synchronize(self):
        self.log.calls.append(("synchronize", self.name))
        self.done = True


@pytest.fixture
def fake_backend(monkeypatch):
    """Pretend 'cpu' is an accelerator whose streams and events log what is done to them."""
    log = _Recorder()
    consumer = _FakeStream(log, "consumer")
    recorded = []
    monkeypatch.setattr(_transfer, "_uses_stream", lambda device: device.type == "cpu")
    monkeypatch.setattr(_transfer, "_current_index", lambda device_type: 0)
    monkeypatch.setattr(_transfer, "_new_stream", lambda device: _FakeStream(log, "side"))
    monkeypatch.setattr(_transfer, "_current_stream", lambda device: consumer)
    monkeypatch.setattr(_transfer, "_new_event", lambda device: _FakeEvent(log))
    monkeypatch.setattr(_transfer, "_record_stream", lambda t, s: recorded.append((t, s.name)) or True)

    def no_device_sync(*args, **kwargs):
        raise AssertionError("a global device synchronize was called")

    monkeypatch.setattr(torch.accelerator, "synchronize", no_device_sync)
    log.recorded = recorded
    return log


def test_stream_copy_orders_with_event_not_device_sync(fake_backend):
    stream = CopyStream("cpu")
    shared = torch.randn(4).to(torch.bfloat16)
    tensors = {"a": shared, "tied": shared, "b": torch.ones(2, dtype=torch.float8_e4m3fn)}
    pending = stream.copy(tensors)
    calls = fake_backend.calls
    record = next(c for c in calls if c[0] == "record")
    assert record[2] == "side"
    assert calls.index(("enter", "side")) < calls.index(record) < calls.index(("exit", "side"))
    assert not pending.ready()
    out = pending.wait()
    assert calls[-1] == ("wait_event", "consumer", record[1])  # the consumer stream waits, the host does not
    assert out["a"] is out["tied"]  # tied tensors copied once
    assert out["a"].dtype == torch.bfloat16 and out["b"].dtype == torch.float8_e4m3fn
    assert torch.equal(_bits(out["b"]), _bits(tensors["b"]))
    assert [s for _, s in fake_backend.recorded] == ["consumer", "consumer"]  # once per unique tensor
    assert not any(call[0] == "synchronize" for call in calls)


def test_stream_copy_blocking_waits_for_its_own_event(fake_backend):
    CopyStream("cpu").copy({"w": torch.zeros(2)}, non_blocking=False)
    assert fake_backend.calls[-1][0] == "synchronize"


def test_device_sources_wait_for_consumer_first(fake_backend):
    # 'cpu' plays the accelerator here, so a cpu source is a device source: the producer may be the consumer.
    CopyStream("cpu").copy({"w": torch.zeros(2)})
    assert fake_backend.calls[0] == ("wait_stream", "side", "consumer")


def test_host_sources_start_at_once_unless_record_stream_is_missing(fake_backend, monkeypatch):
    # 'cpu' plays the accelerator, so make the sources count as host memory.
    monkeypatch.setattr(_transfer, "_is_device_source", lambda tensor, target: False)
    stream = CopyStream("cpu")
    stream.copy({"w": torch.zeros(2)}).wait()
    assert not any(call[0] == "wait_stream" for call in fake_backend.calls)
    monkeypatch.setattr(_transfer, "_record_stream", lambda t, s: False)
    stream.copy({"w": torch.zeros(2)}).wait()
    assert stream._fence_consumer is True
    fake_backend.calls.clear()
    stream.copy({"w": torch.zeros(2)})
    assert fake_backend.calls[0] == ("wait_stream", "side", "consumer")


def test_stream_copy_rejects_other_accelerator(fake_backend):
    stream = CopyStream("cpu")
    stream.device = torch.device("cpu", 0)
    with pytest.raises(ValueError, match="copies to cpu:0, not cpu:1; create one CopyStream per device"):
        stream.copy({"w": torch.zeros(1)}, torch.device("cpu", 1))


# ----------------------------------------------------------------------------- prefetch stager


def test_stager_returns_values_for_cpu_execution():
    values = {"w": torch.ones(3)}
    assert DeviceStager()(values, torch.device("cpu"))["w"] is values["w"]
    assert DeviceStager()(values, None)["w"] is values["w"]


def test_stager_stages_pageable_values_and_copies_pinned_ones_directly(fake_backend, monkeypatch):
    monkeypatch.setattr(_transfer, "pin_memory_enabled", lambda enabled=True: enabled)
    buffers = []
    def unpinned_buffer(capacity):
        buffers.append(StagingBuffer(capacity, pin=False))
        return buffers[-1]

    monkeypatch.setattr(_transfer, "StagingBuffer", unpinned_buffer)
    pinned = torch.arange(4.0)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is pinned)
    stager = DeviceStager(staging_bytes=1024)
    mmapped = torch.randn(300).to(torch.bfloat16)  # 600 bytes: grows the buffer past 1 KiB
    pending = stager({"disk": mmapped, "ram": pinned}, torch.device("cpu"))
    assert isinstance(pending, PendingCopy)
    assert len(buffers) == 1 and buffers[0].capacity == 2048  # next power of two >= 2 x 1024 aligned bytes
    out = pending.wait()
    assert out["disk"].dtype == torch.bfloat16 and torch.equal(out["disk"], mmapped)
    assert torch.equal(out["ram"], pinned)
    assert buffers[0].used == 1024  # released after the copy, reclaimed once the copy's event is done
    pending.event.done = True
    stager({"disk": mmapped}, torch.device("cpu"))
    assert len(buffers) == 1  # the same staging memory is reused, nothing allocated per step


def test_stager_without_pinning_copies_directly(fake_backend, monkeypatch):
    monkeypatch.setattr(_transfer, "pin_memory_enabled", lambda enabled=True: False)
    monkeypatch.setattr(_transfer, "StagingBuffer", None)  # must not be used
    out = DeviceStager()({"w": torch.ones(2, dtype=torch.float8_e4m3fn)}, torch.device("cpu")).wait()
    assert out["w"].dtype == torch.float8_e4m3fn
