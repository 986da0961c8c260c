"""The weights a dispatched model keeps in RAM ("cpu" in the device map) are read ahead from storage too.

``load_checkpoint_and_dispatch`` leaves the CPU part of a map executed on the CPU as memory-mapped
views of the checkpoint's files.  Cold, the first forward would fault them in page by page; instead
they are read on a background thread from dispatch on, module by module (embeddings left out), with
``madvise(WILLNEED)``, and never released (they are what the CPU budget holds).  Counted here,
never timed: the ``will_need`` and ``release`` calls are recorded, and ``mincore`` says what is in RAM.
The pages a load itself brought in (the kernel's read-ahead of the header read, up to
``read_ahead_kb``) are not asked for again.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _page_cache import drop, write_wide_llama
from torch import nn

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks.align_hook import loading_hook_of
from bigmodel.offload import in_order, readahead, resident

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported(), reason="needs madvise/mincore and /proc/self/maps")


@pytest.fixture(autouse=True)
def _through_the_page_cache(monkeypatch):
    """These tests follow the page-cache read-ahead (``madvise`` calls); direct reads: test_direct_streaming."""
    monkeypatch.setenv(readahead.DIRECT_ENV, "0")

CPU_LAYERS = ["model.layers.0", "model.layers.1"]
DISK_LAYERS = ["model.layers.2", "model.layers.3"]
MAP = {"model.embed_tokens": "cpu", **dict.fromkeys(CPU_LAYERS, "cpu"), **dict.fromkeys(DISK_LAYERS, "disk"),
       "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}  # fmt: skip
# Module order (rotary_emb holds no file-backed tensor); the embedding is not read ahead (a forward reads rows).
RESIDENT_ORDER = [*CPU_LAYERS, "model.norm", "lm_head"]
PAGE = os.sysconf("SC_PAGE_SIZE")
IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A 4-layer Llama (float32 safetensors, 16 MB layers, untied head)."""
    return write_wide_llama(tmp_path_factory.mktemp("llama"), 4)


class Calls:
    """Records the spans of every ``will_need`` and ``release`` call, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.need: list[list] = []
        self.released: list[list] = []
        will_need, release = readahead.will_need, readahead.release

        def needing(spans):
            spans = list(spans)
            self.need.append(spans)
            will_need(spans)

        def releasing(spans):
            spans = list(spans)
            self.released.append(spans)
            release(spans)

        monkeypatch.setattr(in_order, "will_need", needing)
        monkeypatch.setattr(readahead, "release", releasing)


def _settle() -> None:
    resident._executor().submit(lambda: None).result()  # the resident part has been read
    readahead._releaser().submit(lambda: None).result()  # the used modules queued for release were released
    readahead._executor().submit(lambda: None).result()  # what was queued has been handed to the kernel


def _pages(spans) -> set[int]:
    return {page for address, length in spans for page in range(address // PAGE, (address + length) // PAGE)}


def _dispatch(folder: Path, tmp_path: Path) -> nn.Module:
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    return load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"))


def _resident_spans(model: nn.Module) -> dict[str, set]:
    mappings = readahead.file_mappings()
    spans = {name: set(readahead.file_spans(model.get_submodule(name).state_dict().values(), mappings))
             for name in RESIDENT_ORDER}  # fmt: skip
    assert all(spans.values())  # zero-copy views of the checkpoint's mapping
    return spans


def _reference(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(IDS).logits


def test_dispatch_reads_the_cold_resident_part_ahead_in_module_order_and_never_releases_it(
        folder, tmp_path, monkeypatch):  # fmt: skip
    monkeypatch.delenv(readahead.ENV, raising=False)
    expected = _reference(folder)
    calls = Calls(monkeypatch)
    drop(folder / "model.safetensors")
    model = _dispatch(folder, tmp_path)
    _settle()
    spans_of = _resident_spans(model)
    owner = {page: name for name, spans in spans_of.items() for page in _pages(spans)}
    advised = [owner[address // PAGE] for spans in calls.need for address, _ in spans if address // PAGE in owner]
    in_order = [name for k, name in enumerate(advised) if k == 0 or advised[k - 1] != name]
    assert in_order == [name for name in RESIDENT_ORDER if name in advised]  # module order
    assert {"model.layers.1", "model.norm"} <= set(in_order)  # cold (the load's header read brings in <= 8 MB)
    embedding = _pages(readahead.file_spans([model.model.embed_tokens.weight], readahead.file_mappings()))
    assert embedding and not embedding & _pages(s for spans in calls.need for s in spans)
    in_ram = set().union(*spans_of.values())
    assert readahead.resident(in_ram)  # before any forward: the read waits for its last pieces
    prefetcher = loading_hook_of(model.get_submodule(DISK_LAYERS[0])).prefetcher
    prefetcher.readahead.available = 1  # the disk layers are released once used (streaming)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
        _settle()
        assert prefetcher.readahead.streaming and calls.released  # the disk layers were released ...
        assert not any(span in in_ram for spans in calls.released for span in spans)  # ... never the resident part
        assert torch.equal(model(IDS).logits, expected)


def test_a_warm_resident_part_or_reading_ahead_off_asks_for_nothing(folder, tmp_path, monkeypatch):
    calls = Calls(monkeypatch)
    monkeypatch.setenv(readahead.ENV, "0")
    drop(folder / "model.safetensors")
    model = _dispatch(folder, tmp_path)
    _settle()
    assert calls.need == []
    monkeypatch.delenv(readahead.ENV)
    for tensor in model.state_dict().values():
        tensor.sum()  # every resident page in RAM
    model = _dispatch(folder, tmp_path)
    _settle()
    in_ram = _pages(set().union(*_resident_spans(model).values()))
    assert not in_ram & _pages(s for spans in calls.need for s in spans)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, _reference(folder))


def _memmap(path: Path, mib: int) -> torch.Tensor:
    np.arange(mib * 2**18, dtype=np.float32).tofile(path)
    drop(path)
    return torch.from_numpy(np.memmap(path, dtype=np.float32, mode="r+"))


def test_read_resident_reads_in_order_skips_anonymous_memory_and_stops_at_the_memory_bound(tmp_path, monkeypatch):
    monkeypatch.delenv(readahead.ENV, raising=False)
    calls = Calls(monkeypatch)
    first, second = _memmap(tmp_path / "a.bin", 4), _memmap(tmp_path / "b.bin", 4)
    groups = [[torch.ones(2**20)], [first], [second]]
    resident.read_resident(groups, available=2**40).result()
    spans = readahead.file_spans([first, second], readahead.file_mappings())
    advised = [piece for pieces in calls.need for piece in pieces]
    assert advised == readahead.pieces(spans[0]) + readahead.pieces(spans[1])  # in order; not the anonymous tensor
    assert readahead.resident(spans)
    calls.need.clear()
    readahead.release(spans)  # the read left them mapped: unmap, then drop
    drop(tmp_path / "a.bin")
    drop(tmp_path / "b.bin")
    assert not readahead.resident(spans[:1]) and not readahead.resident(spans[1:])
    bound = (first.nbytes + second.nbytes // 2) / readahead.STREAM_FRACTION
    resident.read_resident(groups, available=int(bound)).result()  # the second would not fit
    assert [piece for pieces in calls.need for piece in pieces] == readahead.pieces(spans[0])
    monkeypatch.setenv(readahead.ENV, "0")
    assert resident.read_resident(groups, available=2**40) is None  # reading ahead off
    monkeypatch.delenv(readahead.ENV)
    resident.read_resident(groups, available=2**40).result()
    assert readahead.resident(spans)
    assert resident.read_resident(groups, available=2**40) is None  # all in RAM: nothing to read
    assert torch.equal(second[-3:], torch.arange(2**20 - 3, 2**20, dtype=torch.float32))  # values unchanged


def test_the_first_forward_reads_ahead_disk_layers_whose_shards_it_maps_itself(tmp_path, monkeypatch):
    """A sharded checkpoint's disk layers: their files are first mapped when the first forward reads them."""
    monkeypatch.delenv(readahead.ENV, raising=False)
    folder = write_wide_llama(tmp_path / "sharded", 4, max_shard_size="20MB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) >= 4  # about one 16 MB layer per shard
    expected = _reference(folder)
    for shard in shards:
        drop(shard)
    model = _dispatch(folder, tmp_path)
    _settle()
    calls = Calls(monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    _settle()
    advised = {span for spans in calls.need for span in spans}
    mappings = readahead.file_mappings()
    for name in DISK_LAYERS:
        hook = loading_hook_of(model.get_submodule(name))
        spans = set(readahead.file_spans(hook.prefetcher.read(hook).values(), mappings))
        assert spans and spans <= advised, name  # asked for during the first forward


def test_weights_dropped_during_the_read_stay_mapped_until_it_ends(tmp_path, monkeypatch):
    monkeypatch.delenv(readahead.ENV, raising=False)
    groups = [[_memmap(tmp_path / f"{i}.bin", 16)] for i in range(4)]
    future = resident.read_resident(groups, available=2**40)
    del groups  # the only references to the mapped arrays: they are unmapped once the read lets go of them
    future.result()  # no fault on an unmapped page
