"""Prefetch: order learned from the first forward, bounded look-ahead, staged values used, bit-exact."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from bigmodel import align_module_device, disk_offload, dispatch_model
from bigmodel.dispatch import prefetch as _prefetch
from bigmodel.dispatch.prefetch import Prefetcher, stage, touch_pages
from bigmodel.dispatch.prefetch_setup import enable_prefetch


class Chain(nn.Module):
    def __init__(self, n: int = 5, dim: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(n)])

    def forward(self, x, skip_last: bool = False):
        layers = self.layers[:-1] if skip_last else self.layers
        for layer in layers:
            x = torch.tanh(layer(x))
        return x


X = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def offloaded(tmp_path):
    torch.manual_seed(0)
    model = Chain().eval()
    with torch.no_grad():
        expected = model(X)
    disk_offload(model, tmp_path)
    return model, expected


class Recorder:
    """A stage function that records what it staged and checks the look-ahead bound."""

    def __init__(self, prefetcher_box: list) -> None:
        self.box = prefetcher_box
        self.staged: list[str] = []
        self.max_pending = 0
        self.threads: set[str] = set()

    def __call__(self, values, device):
        self.staged.append(sorted(values)[0] if values else "")
        self.threads.add(threading.current_thread().name)
        self.max_pending = max(self.max_pending, self.box[0].pending)
        return stage(values, device)


def test_order_is_learned_and_next_module_is_staged(offloaded):
    model, expected = offloaded
    box: list = []
    recorder = Recorder(box)
    prefetcher = enable_prefetch(model, depth=1, stage=recorder, min_bytes=0)
    box.append(prefetcher)
    hooks = [layer._hf_hook for layer in model.layers]
    with torch.no_grad():
        assert torch.equal(model(X), expected)
        # The first forward follows the order of the modules in the model while it records the actual one:
        # each module is staged ahead of it (the last one stages the first one, for the next forward).
        _prefetch._executor().submit(lambda: None).result()  # the last module's staging has run
        assert prefetcher.recording and prefetcher.order_length == 5 and len(recorder.staged) == 5
        assert torch.equal(model(X), expected)
        assert torch.equal(model(X), expected)
    _prefetch._executor().submit(lambda: None).result()
    assert not prefetcher.recording
    assert len(recorder.staged) == 15  # every module, in every forward
    assert recorder.max_pending <= 1
    assert all(name.startswith("bigmodel-prefetch") for name in recorder.threads)
    assert all(h.prefetcher is prefetcher for h in hooks)


def test_depth_two_stays_bounded(offloaded):
    model, expected = offloaded
    box: list = []
    recorder = Recorder(box)
    box.append(enable_prefetch(model, depth=2, stage=recorder, min_bytes=0))
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(X), expected)
            assert box[0].pending <= 2
    assert recorder.max_pending <= 2


def test_changed_execution_order_stays_exact(offloaded):
    model, expected = offloaded
    torch.manual_seed(0)
    plain = Chain().eval()  # same weights as the fixture's model
    prefetcher = enable_prefetch(model, depth=2, min_bytes=0)
    with torch.no_grad():
        expected_short = plain(X, skip_last=True)
        model(X)
        model(X)
        assert torch.equal(model(X, skip_last=True), expected_short)  # staged modules skipped over
        assert torch.equal(model(X), expected)
        assert torch.equal(model(X, skip_last=True), expected_short)
    assert prefetcher.pending <= 2


def test_staged_value_with_wait_protocol(offloaded):
    model, expected = offloaded
    waited = []

    class Pending:
        def __init__(self, values):
            self.values = values

        def wait(self):
            waited.append(True)
            return self.values

    enable_prefetch(model, depth=1, stage=lambda values, device: Pending(values), min_bytes=0)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(X), expected)
    assert waited


def test_prefetch_disabled_by_env(offloaded, monkeypatch):
    model, _ = offloaded
    monkeypatch.setenv("BIGMODEL_PREFETCH_DEPTH", "0")
    assert enable_prefetch(model) is None
    assert all(layer._hf_hook.prefetcher is None for layer in model.layers)
    monkeypatch.setenv("BIGMODEL_PREFETCH_DEPTH", "7")
    assert enable_prefetch(model, min_bytes=0).depth == 2  # capped


def test_small_modules_are_not_prefetched(offloaded):
    model, expected = offloaded
    box: list = []
    recorder = Recorder(box)
    box.append(enable_prefetch(model, depth=1, stage=recorder))  # default min_bytes: 1 MiB
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(X), expected)
    assert recorder.staged == []


def test_align_module_device_invalidates_staged_values(offloaded):
    model, _ = offloaded
    prefetcher = enable_prefetch(model, depth=2, min_bytes=0)
    with torch.no_grad():
        model(X)
        model(X)
        with align_module_device(model.layers[1]):
            model.layers[1].weight.data.zero_()
        assert prefetcher.pending == 0
        outputs = []
        model.layers[1].register_forward_hook(lambda m, a, out: outputs.append(out))
        model(X)
    bias = model.layers[1]._hf_hook.weights_map["bias"]
    assert torch.equal(outputs[0], bias.expand(3, 16))  # the zeroed weight, not a stale staged one


def test_touch_pages_reads_mmap_without_copy(tmp_path):
    from bigmodel import OffloadedWeightsLoader, offload_state_dict

    offload_state_dict(tmp_path, {"w": torch.arange(10_000, dtype=torch.float32)})
    tensor = OffloadedWeightsLoader(save_folder=tmp_path)["w"]
    pointer = tensor.data_ptr()
    staged = stage({"w": tensor}, torch.device("cpu"))
    assert staged["w"] is tensor and tensor.data_ptr() == pointer
    touch_pages(torch.empty(0))
    touch_pages(tensor[::2])  # non-contiguous: left alone


def test_dispatch_with_prefetch_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    model = Chain(n=6).eval()
    with torch.no_grad():
        expected = model(X)
    device_map = {"layers.0": "cpu", "layers.1": "disk", "layers.2": "disk", "layers.3": "cpu", "layers.4": "disk",
                  "layers.5": "disk"}
    dispatch_model(model, device_map, offload_dir=tmp_path)
    prefetcher = enable_prefetch(model, depth=1, min_bytes=0)
    assert prefetcher.depth == 1
    with torch.no_grad():
        for _ in range(4):
            assert torch.equal(model(X), expected)
    assert prefetcher.order_length == 4


def test_prefetcher_read_errors_surface_on_take():
    class Hook:
        weights_map = {}
        offloaded_names = ["missing"]
        offloaded_bytes = 1
        device = None

    prefetcher = Prefetcher(depth=1, min_bytes=0)
    with pytest.raises(KeyError, match="missing"):
        prefetcher.take(Hook())


def test_pages_resident_asks_the_kernel():
    from bigmodel.dispatch import prefetch as _prefetch

    if _prefetch._MINCORE is None:
        pytest.skip("no mincore on this platform")
    import mmap

    # A fresh anonymous mapping: its pages are not in RAM until written (torch.empty may reuse
    # heap memory that earlier tests already faulted in).
    region = mmap.mmap(-1, 64 * 2**20)
    untouched = torch.frombuffer(region, dtype=torch.uint8)
    assert not _prefetch.pages_resident(untouched)
    untouched[: 32 * 2**20].fill_(1)
    assert not _prefetch.pages_resident(untouched)  # the end is still not in RAM
    untouched.fill_(1)
    assert _prefetch.pages_resident(untouched)
    assert _prefetch.pages_resident(torch.empty(0))
    assert not _prefetch.pages_resident(torch.ones(8, 8).t())  # non-contiguous: unknown, so read ahead


@pytest.mark.parametrize("resident", [True, False])
def test_cpu_read_ahead_only_for_pages_not_in_ram(offloaded, monkeypatch, resident):
    from bigmodel.dispatch import prefetch as _prefetch

    model, expected = offloaded
    touched: list[int] = []
    monkeypatch.setattr(_prefetch, "pages_resident", lambda tensor: resident)
    monkeypatch.setattr(_prefetch, "touch_pages", lambda tensor: touched.append(tensor.numel()))
    prefetcher = enable_prefetch(model, depth=1, min_bytes=0)
    assert prefetcher.in_place
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(X), expected)
    _prefetch._executor().submit(lambda: None).result()  # let the last read ahead finish
    assert (touched == []) is resident  # nothing to read when every page is in RAM


def test_resident_modules_are_rechecked_only_every_few_turns(offloaded, monkeypatch):
    from bigmodel.dispatch import prefetch as _prefetch

    model, expected = offloaded
    asked: list[int] = []
    resident = [True]
    touched: list[int] = []
    monkeypatch.setattr(_prefetch, "pages_resident", lambda tensor: asked.append(tensor.numel()) or resident[0])
    monkeypatch.setattr(_prefetch, "touch_pages", lambda tensor: touched.append(tensor.numel()))
    prefetcher = enable_prefetch(model, depth=1, min_bytes=0)
    forwards = 2 * _prefetch.RECHECK_EVERY + 1
    with torch.no_grad():
        for _ in range(forwards):
            assert torch.equal(model(X), expected)
    # 5 modules x 2 tensors; every module comes up once per forward after the recording one.
    turns = 5 * (forwards - 1) - 1  # the first module of the recording forward is not read ahead
    checks = len(asked) // 2
    assert 0 < checks <= -(-turns // _prefetch.RECHECK_EVERY) + 5
    assert touched == []

    # Evicted pages are noticed at the next check; invalidate() forgets what was trusted.
    resident[0] = False
    prefetcher.invalidate()
    asked.clear()
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    _prefetch._executor().submit(lambda: None).result()
    assert len(asked) >= 4 and touched  # the modules are asked again (first tensor: not in RAM), then read ahead


def test_cpu_take_does_not_wait_for_an_unfinished_read_ahead():
    from concurrent.futures import Future

    class Hook:
        weights_map = {"w": torch.ones(2)}
        offloaded_names = ["w"]
        offloaded_bytes = 8
        device = torch.device("cpu")

    hook = Hook()
    prefetcher = Prefetcher(depth=1, min_bytes=0)
    prefetcher._pending[id(hook)] = Future()  # never completes
    assert torch.equal(prefetcher.take(hook)["w"], torch.ones(2))
    assert prefetcher.pending == 0


def test_resident_modules_are_asked_again_by_the_spans_of_their_values(offloaded, monkeypatch):
    """After a module's values were found in RAM, its residency is asked with a few ``mincore`` calls on
    the merged spans of their memory, without reading the values or asking about each one again."""
    from bigmodel.dispatch import prefetch as _prefetch

    model, expected = offloaded
    asked: list[int] = []
    real = _prefetch.pages_resident
    monkeypatch.setattr(_prefetch, "pages_resident", lambda tensor: asked.append(tensor.numel()) or real(tensor))
    enable_prefetch(model, depth=1, min_bytes=0)
    with torch.no_grad():
        for _ in range(4 * _prefetch.RECHECK_EVERY):
            assert torch.equal(model(X), expected)
    assert 0 < len(asked) <= 5 * 2  # each module's two tensors, once

    monkeypatch.setattr(_prefetch, "resident", lambda spans: False)  # pages evicted since
    asked.clear()
    with torch.no_grad():
        for _ in range(_prefetch.RECHECK_EVERY):
            assert torch.equal(model(X), expected)
    assert len(asked) >= 5  # each module's values read and asked about again
