"""The accelerator prefetch path on a simulated accelerator (tests/_fake_accelerator.py): copies are
deferred until ordered, so a staging region reused early or a value read before its copy gives
wrong outputs here.  The GPU twin of these tests is tests/transfer/test_accelerator_prefetch.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _fake_accelerator import (
    copies_module,
    dispatch_as_accelerator,
    install,
    pinned_module,
)
from torch import nn

from bigmodel import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    remove_hook_from_submodules,
)
from bigmodel.transfer.staging import StagedBatch, StagingBuffer

DIM = 40
MODULE_BYTES = 6656 + 512  # a Linear's weight (6400 bytes) plus its bias, each aligned to 512 bytes in the ring


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.tanh(self.proj(self.norm(x)))


class Net(nn.Module):
    def __init__(self, n: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


X = torch.randn(3, DIM, generator=torch.Generator().manual_seed(0))
CPU_DISK = {"blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk", "blocks.3": "cpu", "blocks.4": "disk",
            "head": "cpu"}


@pytest.fixture
def fake(monkeypatch):
    backend = install(monkeypatch)
    dispatch_as_accelerator(monkeypatch)
    return backend


def _net() -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    with torch.no_grad():
        return model, model(X)


def _offload(kind: str, model: Net, tmp_path, depth: int):
    if kind == "cpu_offload":
        cpu_offload(model, execution_device="cpu")
    elif kind == "disk_offload":
        disk_offload(model, tmp_path, execution_device="cpu")
    else:
        dispatch_model(model, CPU_DISK, main_device="cpu", offload_dir=tmp_path)
    prefetcher = model.blocks[1].proj._hf_hook.prefetcher
    prefetcher.depth = depth
    prefetcher.min_bytes = 2048  # the Linears are prefetched, the LayerNorms are below the threshold
    # The stager's ring holds at least twice the largest module (rounded up to a power of two,
    # 16 KiB here): fewer than three of these modules fit, the ring wraps every other module.
    prefetcher.stage.staging_bytes = MODULE_BYTES
    return prefetcher


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kind", ["cpu_offload", "disk_offload", "dispatch_cpu_disk"])
def test_twenty_forwards_through_a_wrapping_ring_are_bit_exact(fake, kind, depth, tmp_path):
    model, expected = _net()
    prefetcher = _offload(kind, model, tmp_path, depth)
    with torch.no_grad():
        for _ in range(20):
            assert torch.equal(model(X), expected)
    assert fake.copies > 0 and any(stream.done for stream in fake.streams)  # side-stream copies really ran
    if kind != "cpu_offload":  # disk values went through the ring and reused it
        assert prefetcher.stage._staging is not None and prefetcher.stage._staging.capacity < 3 * MODULE_BYTES


def test_a_missing_ring_fence_is_caught_by_the_simulation(fake, tmp_path, monkeypatch):
    """The simulation is strict enough: releasing a staged region without waiting for its copy corrupts outputs."""
    model, expected = _net()
    _offload("disk_offload", model, tmp_path, depth=2)
    real_release = StagedBatch.release
    monkeypatch.setattr(StagedBatch, "release", lambda self, after=None: real_release(self))
    with torch.no_grad():
        outputs = [model(X) for _ in range(6)]
    assert not all(torch.equal(out, expected) for out in outputs)


def test_the_copy_fence_waits_on_the_forward_threads_stream(fake, tmp_path, monkeypatch):
    """Without record_stream the copy stream must wait for the consumer: the forward thread's
    current stream, never the prefetch worker's own default stream."""
    monkeypatch.setattr(copies_module, "_record_stream", lambda tensor, stream: False)
    model, expected = _net()
    _offload("disk_offload", model, tmp_path, depth=1)
    with torch.no_grad():
        for _ in range(6):
            assert torch.equal(model(X), expected)
    waits = [call for call in fake.log if call[0] == "wait_stream"]
    assert waits, "the consumer fence never ran"
    assert {call[2] for call in waits} == {"compute"}


def test_an_execution_device_without_index_is_resolved_on_the_forward_thread(fake, tmp_path, monkeypatch):
    """``execution_device="cuda"`` means the forward thread's current device, not the worker's (always 0)."""
    forward = threading.current_thread()
    monkeypatch.setattr(copies_module, "_current_index", lambda device_type: 1 if threading.current_thread() is forward
                        else 0)
    model, expected = _net()
    prefetcher = _offload("disk_offload", model, tmp_path, depth=1)
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(X), expected)
    assert set(prefetcher.stage._streams) == {torch.device("cpu", 1)}


def test_staging_buffer_falls_back_to_pageable_when_pinning_fails(fake, tmp_path, monkeypatch, caplog):
    def refuse(nbytes):
        raise RuntimeError("cudaHostAlloc failed: out of locked memory")

    monkeypatch.setattr(pinned_module, "_pinned_arena", refuse)
    staged = []
    real_stage = StagingBuffer.stage
    monkeypatch.setattr(StagingBuffer, "stage", lambda self, *a, **k: staged.append(1) or real_stage(self, *a, **k))
    model, expected = _net()
    prefetcher = _offload("disk_offload", model, tmp_path, depth=1)
    with torch.no_grad(), caplog.at_level("WARNING"):
        for _ in range(5):
            assert torch.equal(model(X), expected)
    assert caplog.text.count("BIGMODEL_PIN_MEMORY=0") == 1  # said once, with the way to skip pinning
    assert not prefetcher.stage._staging.pinned
    assert staged == []  # pageable values are copied directly: no extra copy through unpinned memory
    assert fake.copies > 0


@pytest.mark.parametrize("kind", ["disk_offload", "dispatch_cpu_disk"])
def test_steady_state_forwards_never_read_weights_on_the_forward_thread(fake, kind, tmp_path):
    """Small modules (LayerNorms) are staged with the large ones: after the order is learned no module
    is read and copied from pageable memory on the compute stream."""
    model, expected = _net()
    prefetcher = _offload(kind, model, tmp_path, depth=1)
    forward = threading.current_thread()
    reads = []
    real_read = prefetcher.read

    def read(hook):
        if threading.current_thread() is forward:
            reads.append(hook.module_name)
        return real_read(hook)

    prefetcher.read = read
    with torch.no_grad():
        model(X)
        model(X)
        reads.clear()
        for _ in range(5):
            assert torch.equal(model(X), expected)
    assert reads == []


def test_remove_hooks_after_prefetching_brings_weights_back(fake, tmp_path):
    model, expected = _net()
    _offload("dispatch_cpu_disk", model, tmp_path, depth=2)
    with torch.no_grad():
        for _ in range(3):
            model(X)
    remove_hook_from_submodules(model)
    fake.drain()
    with torch.no_grad():
        assert torch.equal(model(X), expected)
