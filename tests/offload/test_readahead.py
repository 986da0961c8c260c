"""Reading offloaded weights ahead from storage: real files, real mappings, the real page cache."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from _fake_accelerator import drain_workers
from _page_cache import drop
from safetensors.torch import save_file
from torch import nn

from bigmodel import disk_offload
from bigmodel.offload import in_order, readahead
from bigmodel.offload.storage import OffloadedWeightsLoader

pytestmark = pytest.mark.skipif(not readahead.supported(), reason="needs madvise/mincore and /proc/self/maps")


@pytest.fixture(autouse=True)
def _through_the_page_cache(monkeypatch):
    """These tests follow the page-cache read-ahead (``madvise`` calls); direct reads: test_direct_streaming."""
    monkeypatch.setenv(readahead.DIRECT_ENV, "0")


def _mapped(tmp_path, mib: int = 8) -> tuple[torch.Tensor, str]:
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.arange(mib * 2**18, dtype=torch.float32)}, path)
    drop(path)
    index = {"w": {"safetensors_file": path, "weight_name": "w", "dtype": "float32", "shape": [mib * 2**18]}}
    return OffloadedWeightsLoader(index=index)["w"], path


def test_file_spans_cover_mapped_tensors_and_skip_anonymous_memory(tmp_path):
    mapped, _ = _mapped(tmp_path)
    anonymous = torch.ones(2**20)
    spans = readahead.file_spans([mapped, anonymous], readahead.file_mappings())
    assert len(spans) == 1
    address, length = spans[0]
    assert address <= mapped.data_ptr() < mapped.data_ptr() + mapped.nbytes <= address + length
    assert length - mapped.nbytes < 2 * os.sysconf("SC_PAGE_SIZE")


def test_inner_spans_leave_out_the_pages_shared_with_other_tensors(tmp_path):
    """The pages a release drops: wholly inside the given tensors (merged where they touch), never the page
    they share with the file's header or the next tensor."""
    page = os.sysconf("SC_PAGE_SIZE")
    path = str(tmp_path / "three.safetensors")
    save_file({"a": torch.ones(3000), "b": torch.ones(5000), "c": torch.ones(100)}, path)
    index = {k: {"safetensors_file": path, "weight_name": k, "dtype": "float32", "shape": [n]}
             for k, n in (("a", 3000), ("b", 5000), ("c", 100))}
    loader = OffloadedWeightsLoader(index=index)
    a, b, c = loader["a"], loader["b"], loader["c"]
    assert a.data_ptr() + a.nbytes == b.data_ptr() and b.data_ptr() + b.nbytes == c.data_ptr()  # one after the other
    mappings = readahead.file_mappings()
    spans = readahead.inner_spans([b, a, torch.ones(10)], mappings)  # any order; anonymous memory left out
    assert len(spans) == 1
    lo, length = spans[0]
    assert lo % page == 0 and length % page == 0
    assert a.data_ptr() <= lo and lo - a.data_ptr() < page  # a's first page holds the header's end
    assert lo + length <= c.data_ptr() < lo + length + page  # the page holding c's first bytes is kept
    assert length == (c.data_ptr() // page - -(-a.data_ptr() // page)) * page
    assert readahead.inner_spans([c], mappings) == []  # 400 bytes: no page of its own
    outer = readahead.file_spans([a, b], mappings)
    assert sum(size for _, size in outer) > length


def test_will_need_reads_a_cold_range_into_ram_without_touching_it(tmp_path):
    mapped, path = _mapped(tmp_path)
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    drop(path)
    assert not readahead.resident(spans)
    readahead.will_need(spans)
    for _ in range(200):  # the reads are asynchronous: wait for them (up to 2 s)
        if readahead.resident(spans):
            break
        time.sleep(0.01)
    assert readahead.resident(spans)
    assert torch.equal(mapped[:5], torch.arange(5, dtype=torch.float32))  # values unchanged


def test_release_drops_pages_and_the_values_read_back_the_same(tmp_path):
    mapped, _ = _mapped(tmp_path)
    expected = mapped.clone()
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    assert float(mapped.sum()) == float(expected.sum())  # every page faulted in
    assert readahead.resident(spans)
    readahead.release(spans)
    assert torch.equal(mapped, expected)  # a released page is read again from the file


def _disk_offloaded_linears(tmp_path, dim: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """Four ``dim`` x ``dim`` Linears offloaded to a folder, an input, and the output before offloading."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(dim, dim) for _ in range(4)])
    x = torch.randn(2, dim)
    expected = model(x)
    disk_offload(model, tmp_path / "offload", execution_device="cpu")
    return model, x, expected


def test_readahead_of_a_disk_offloaded_model_starts_when_its_weights_are_cold(tmp_path):
    model, x, expected = _disk_offloaded_linears(tmp_path, 512)
    with torch.no_grad():
        model(x)  # learns the order
        assert torch.allclose(model(x), expected, atol=1e-6)
        prefetcher = model[0]._hf_hook.prefetcher
        assert not prefetcher.readahead.active  # warm: nothing to read ahead
        for name in os.listdir(tmp_path / "offload"):
            readahead.release(readahead.file_spans(
                [model[0]._hf_hook.weights_map.dataset[name[:-4]]] if name.endswith(".dat") else [],
                readahead.file_mappings()))
            drop(str(tmp_path / "offload" / name))
        assert torch.allclose(model(x), expected, atol=1e-6)
        assert prefetcher.readahead.active  # cold at the forward's start: reading ahead


def test_a_cold_model_whose_first_module_was_read_back_is_read_ahead(tmp_path):
    """The forward after a warm one would skip the prefetch work if the offloaded modules seemed in RAM;
    the first module's pages alone do not say so (the last forward's staging reads it back).  16 MB
    modules: reading the first back reads no page of the last (the kernel reads around a fault)."""
    model, x, expected = _disk_offloaded_linears(tmp_path, 2048)
    with torch.no_grad():
        model(x), model(x)  # records the order; the second finds all in RAM: the next may be quiet
        prefetcher = model[0]._hf_hook.prefetcher
        drain_workers()
        dataset = model[0]._hf_hook.weights_map.dataset
        views = [dataset[f"{i}.{kind}"] for i in range(4) for kind in ("weight", "bias")]
        readahead.release(readahead.file_spans(views, readahead.file_mappings()))
        for name in os.listdir(tmp_path / "offload"):
            drop(str(tmp_path / "offload" / name))
        float(dataset["0.weight"].sum() + dataset["0.bias"].sum())  # module 0 read back, as staging does
        spans = [readahead.file_spans([dataset[f"{i}.weight"]], readahead.file_mappings()) for i in (0, 3)]
        assert readahead.resident(spans[0]) and not readahead.resident(spans[1])
        assert torch.allclose(model(x), expected, atol=1e-6)
        assert not prefetcher.quiet and prefetcher.readahead.active


def test_reads_in_flight_follow_the_largest_module(tmp_path, monkeypatch):
    """A sixth of the largest module read ahead, from IN_FLIGHT_BYTES to IN_FLIGHT_MAX (64 and 128 MB):
    810 MB decoder layers read faster 128 MB deep, ~100 MB layers 64 MB deep."""
    assert readahead.in_flight_for(100 * 10**6) == 64 << 20
    assert readahead.in_flight_for(600 << 20) == 100 << 20
    assert readahead.in_flight_for(810 * 10**6) == readahead.in_flight_for(8 << 30) == 128 << 20
    monkeypatch.setattr(in_order, "IN_FLIGHT_BYTES", 64 << 10)
    monkeypatch.setattr(in_order, "IN_FLIGHT_MAX", 4 << 20)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 256))  # 4 MiB + 4 KiB, then 1 MiB + 1 KiB
    disk_offload(model, tmp_path / "offload", execution_device="cpu")
    with torch.no_grad():
        model(torch.randn(1, 1024))
    drain_workers()  # its reads ahead end here, not in the next test
    reads = model[0]._hf_hook.prefetcher.readahead._reads
    assert (4 << 20) // 6 <= reads.window <= ((4 << 20) + 2 * 4096) // 6  # the larger module's bytes / 6


def test_readahead_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(readahead.ENV, "0")
    assert not readahead.ReadAhead(lambda hook: {}).enabled


def test_will_need_reads_all_of_a_span_longer_than_one_advice_reads(tmp_path):
    # The kernel reads at most the device's read-ahead size (read_ahead_kb) per WILLNEED call.
    path = str(tmp_path / "long.safetensors")
    device = os.stat(tmp_path).st_dev
    step = readahead.advice_bytes(f"{os.major(device):x}:{os.minor(device):x}")
    if step > 32 << 20:
        pytest.skip(f"read_ahead_kb of {tmp_path}'s device is {step >> 10}: the file would be too large")
    save_file({"w": torch.arange(3 * step // 4 + 1000, dtype=torch.float32)}, path)
    drop(path)
    index = {"w": {"safetensors_file": path, "weight_name": "w", "dtype": "float32", "shape": [3 * step // 4 + 1000]}}
    mapped = OffloadedWeightsLoader(index=index)["w"]
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    assert spans[0][1] > 2 * step
    readahead.will_need(spans)
    for _ in range(300):  # the reads are asynchronous: wait for them (up to 3 s)
        if readahead.resident(spans):  # its first and last pages
            break
        time.sleep(0.01)
    assert readahead.resident(spans)
    assert torch.equal(mapped[-3:], torch.arange(3 * step // 4 + 997, 3 * step // 4 + 1000, dtype=torch.float32))


def test_in_order_reads_ask_in_order_with_at_most_a_window_in_flight(tmp_path, monkeypatch):
    """A deep queue of reads completes in no order: InOrder asks for the next piece only once the
    pieces before it, but for ``window`` bytes, have arrived, and returns from ``wait`` with all in RAM."""
    mapped, _ = _mapped(tmp_path, mib=40)
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    pieces = [piece for span in spans for piece in readahead.pieces(span)]
    assert len(pieces) >= 4  # several pieces (one per read_ahead_kb of the device), so the window matters
    reads = readahead.InOrder(window=2 * pieces[0][1])  # two pieces in flight at most
    events, will_need, arrived = [], readahead.will_need, readahead.InOrder._arrived

    def asking(spans):
        spans = list(spans)
        events.append(("ask", spans[0], sum(length for (_, length), *_ in reads._in_flight)))
        will_need(spans)

    def waiting(self):
        events.append(("arrived", self._in_flight[0][0], None))
        arrived(self)

    monkeypatch.setattr(in_order, "will_need", asking)
    monkeypatch.setattr(readahead.InOrder, "_arrived", waiting)
    reads.read(spans, keep=mapped)
    reads.wait()
    asked = [piece for kind, piece, _ in events if kind == "ask"]
    assert asked == pieces  # in order, each once
    assert [piece for kind, piece, _ in events if kind == "arrived"] == pieces  # all waited for, in order
    for kind, piece, in_flight in events:
        if kind == "ask":
            assert in_flight == 0 or in_flight + piece[1] <= reads.window, events  # the window bounds the queue
    assert readahead.resident(spans)
    assert torch.equal(mapped[-3:], torch.arange(40 * 2**18 - 3, 40 * 2**18, dtype=torch.float32))


def test_in_order_reads_of_a_module_released_meanwhile_stop(tmp_path, monkeypatch):
    """Once ``used`` is set (its module ran and is being released), no more of its pieces are asked
    for, and those in flight are dropped from the queue without being touched (which would read back
    what the release drops)."""
    mapped, _ = _mapped(tmp_path, mib=40)
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    pieces = [piece for span in spans for piece in readahead.pieces(span)]
    assert len(pieces) >= 4
    reads, used, asked, touched = readahead.InOrder(window=2 * pieces[0][1]), threading.Event(), [], []
    will_need, arrived = readahead.will_need, readahead.InOrder._arrived

    def asking(spans):
        spans = list(spans)
        asked.extend(spans)
        will_need(spans)
        if len(asked) == 2:
            used.set()

    frombuffer = torch.frombuffer

    def touching(*args, **kwargs):
        touched.append(args)
        return frombuffer(*args, **kwargs)

    monkeypatch.setattr(in_order, "will_need", asking)
    monkeypatch.setattr(torch, "frombuffer", touching)
    reads.read(spans, keep=mapped, used=used)
    assert asked == pieces[:2]
    assert [piece for piece, *_ in reads._in_flight] == pieces[:2]
    reads.wait()
    assert not reads._in_flight and reads._waiting == 0 and touched == []
    reads.read(spans[:1], keep=mapped, used=threading.Event())  # another module's reads go on, and are waited for
    reads.wait()
    assert asked[2:] == readahead.pieces(spans[0]) and len(touched) == len(readahead.pieces(spans[0]))


def test_no_piece_of_a_module_is_asked_for_once_its_release_began(tmp_path, monkeypatch):
    """The module runs and its release (on another thread) begins while the reading thread waits for a
    piece to arrive before asking for the next: that next piece is not asked for after the release
    (it was, the check of ``used`` coming before the wait: a race the streaming test met under load)."""
    drain_workers()  # no read ahead of an earlier test's model asks for pieces meanwhile
    mapped, _ = _mapped(tmp_path, mib=40)
    spans = readahead.file_spans([mapped], readahead.file_mappings())
    pieces = [piece for span in spans for piece in readahead.pieces(span)]
    assert len(pieces) >= 4
    reads, used, events = readahead.InOrder(window=pieces[0][1]), threading.Event(), []
    will_need, release, arrived = readahead.will_need, readahead.release, readahead.InOrder._arrived

    def asking(spans):
        spans = list(spans)
        events.extend(("need", span) for span in spans)
        will_need(spans)

    def releasing(spans):
        spans = list(spans)
        events.extend(("release", span) for span in spans)
        release(spans)

    def arriving(self):
        if not used.is_set():  # the module ran: its release begins on another thread
            used.set()
            thread = threading.Thread(target=readahead._release, args=(spans, mapped), kwargs={"reads": reads})
            thread.start()
            thread.join()
        arrived(self)

    monkeypatch.setattr(in_order, "will_need", asking)
    monkeypatch.setattr(readahead, "release", releasing)
    monkeypatch.setattr(readahead.InOrder, "_arrived", arriving)
    reads.read(spans, keep=mapped, used=used)
    reads.wait()
    kinds = [kind for kind, _ in events]
    assert events[0] == ("need", pieces[0]) and "release" in kinds
    assert "need" not in kinds[kinds.index("release"):], events
    assert torch.equal(mapped[:3], torch.arange(3, dtype=torch.float32))  # values unchanged, read again


def test_a_new_pass_does_not_wait_for_the_last_passes_reads(tmp_path, monkeypatch):
    """The last pieces a cold forward asked for are still tracked when it ends. The next cold pass must
    not touch them before asking for its own first pieces: the kernel may have dropped them meanwhile
    (here it did), and touching reads them back one page fault at a time while no read of the new pass
    is in flight (64 MB at the start of each cold forward of the 2 GB benchmark fixture)."""
    drain_workers()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])  # 1 MiB per module: one piece each
    x = torch.randn(2, 512)
    expected = model(x)
    folder = tmp_path / "offload"
    disk_offload(model, folder, execution_device="cpu")
    hook = model[0]._hf_hook
    weights = [hook.weights_map.dataset[name[:-4]] for name in os.listdir(folder) if name.endswith(".dat")]

    def cold() -> None:
        drain_workers()
        readahead.release(readahead.file_spans(weights, readahead.file_mappings()))
        for name in os.listdir(folder):
            drop(str(folder / name))

    events = []
    will_need, arrived = readahead.will_need, readahead.InOrder._arrived

    def asking(spans):
        spans = list(spans)
        events.extend(("need", span) for span in spans)
        will_need(spans)

    def arriving(self):
        events.append(("touch", self._in_flight[0][0]))
        arrived(self)

    monkeypatch.setattr(in_order, "will_need", asking)
    monkeypatch.setattr(readahead.InOrder, "_arrived", arriving)
    monkeypatch.setattr(readahead, "in_flight_for", lambda largest: 1 << 20)  # one module: waits at each ask
    with torch.no_grad():
        model(x)  # learns the order
        cold()
        model(x)
        drain_workers()
        assert hook.prefetcher.readahead._reads._in_flight  # the last pass's last pieces, never waited for
        cold()
        events.clear()
        assert torch.allclose(model(x), expected, atol=1e-6)
        drain_workers()
    touched = [(i, piece) for i, (kind, piece) in enumerate(events) if kind == "touch"]
    assert touched, events  # the window made the reads wait
    for i, piece in touched:
        assert ("need", piece) in events[:i], f"touched {piece} before this pass asked for it: {events}"
