"""Streaming with direct reads: released modules read with ``O_DIRECT`` into reused slots (offload.direct).

The model of the streaming tests (10 disk blocks of 15.8 MB, a page cache too small for them) is run
with direct reads allowed: the logits equal the in-memory model's at every forward, the released blocks
come from slots (their mapped pages are never read into the page cache), at most ``stream_ahead + 2``
slots exist, and a slot still viewed by a tensor is never read into.  Counted, never timed.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from _fake_accelerator import drain_workers
from _page_cache import drop, write_wide_llama
from _slot_takes import Takes
from _streamed_llama import AVAILABLE, BLOCKS, IDS, KEPT, MAP

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks.align_hook import loading_hook_of
from bigmodel.offload import direct, fills, readahead

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported() or not direct.layout_possible(),
                                reason="needs madvise/mincore, /proc/self/maps and O_DIRECT")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_wide_llama(tmp_path_factory.mktemp("llama"), len(BLOCKS))


def _reference(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(IDS).logits


def _streamed(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(readahead.ENV, raising=False)
    monkeypatch.delenv(readahead.DIRECT_ENV, raising=False)
    gc.collect()
    expected = _reference(folder)
    gc.collect()
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    model.eval()
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"))
    hooks = {name: loading_hook_of(model.get_submodule(name)) for name in BLOCKS}
    values_of = {name: hook.prefetcher.read(hook).values() for name, hook in hooks.items()}
    mappings = readahead.file_mappings()  # after the reads: they map the file
    spans_of = {name: readahead.file_spans(values, mappings) for name, values in values_of.items()}
    assert all(spans_of.values())
    drain_workers()
    drop(folder / "model.safetensors")
    reads = hooks[BLOCKS[0]].prefetcher.readahead
    reads.window, reads.available = 1, AVAILABLE
    reads.direct.fraction = 1.0  # four 15.8 MB slots in 180 MB
    return model, expected, hooks, spans_of, reads, Takes(monkeypatch)


def test_released_blocks_come_from_slots_bit_identical_and_never_enter_the_page_cache(folder, tmp_path, monkeypatch):
    """The first forward reads every block into slots (it fills no page cache); each later one reads up to a
    third of the kept blocks' bytes (one block here) into the page cache, where they stay, and the rest into
    slots.  Released blocks never enter the page cache (but the first, which the last block's prefetch reads
    back for the next forward)."""
    model, expected, hooks, spans_of, reads, takes = _streamed(folder, tmp_path, monkeypatch)
    released = [name for name in BLOCKS if name not in KEPT]
    assert not any(readahead.resident(spans) for spans in spans_of.values())
    with torch.no_grad():
        for forward in range(6):
            takes.served.clear()
            assert torch.equal(model(IDS).logits, expected), forward
            drain_workers()
            assert reads.streaming and reads._direct
            assert [name for name, k in zip(BLOCKS, reads._kept) if k] == KEPT
            cached = KEPT[:forward]  # one more kept block per forward after the first
            assert [name for name in BLOCKS if id(hooks[name]) in takes.served] == [n for n in BLOCKS if n not in cached]
            assert [name for name in BLOCKS if readahead.resident(spans_of[name])] == sorted(cached + released[:1])
            assert len(reads.direct._slots) <= reads.stream_ahead + 1


def test_with_gradients_the_mapped_views_are_used(folder, tmp_path, monkeypatch):
    """A slot read into again after its module ran would change a tensor saved for backward: with gradients
    recorded, nothing is taken from slots (the logits still equal)."""
    model, expected, _, _, reads, takes = _streamed(folder, tmp_path, monkeypatch)
    assert torch.equal(model(IDS).logits.detach(), expected)
    drain_workers()
    assert reads.streaming and takes.served == []


def test_direct_reads_off_by_environment(folder, tmp_path, monkeypatch):
    model, expected, _, _, reads, takes = _streamed(folder, tmp_path, monkeypatch)
    monkeypatch.setenv(readahead.DIRECT_ENV, "0")
    reads.reset()
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    drain_workers()
    assert reads.streaming and not reads._direct and takes.served == []


def test_hooks_that_do_not_take_slot_views_are_read_through_the_page_cache(folder, tmp_path, monkeypatch):
    """An accelerator-executed hook stages its mapped views itself (pinned copies): nothing is read into slots
    for it (no one would take them), its bytes are asked for in the page cache as before."""
    model, expected, _, spans_of, reads, takes = _streamed(folder, tmp_path, monkeypatch)
    reads.takes_direct = lambda hook: False
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    drain_workers()
    assert reads.streaming and not reads._direct and takes.served == [] and reads.direct._slots == []


def test_a_model_that_fits_reads_its_first_forward_directly_then_fills_the_page_cache(folder, tmp_path, monkeypatch):
    """Not streaming (the offloaded bytes fit in memory): the first forward reads every block into slots, each
    later one reads a third of the offloaded bytes (three blocks here) into the page cache and the rest into
    slots, until all are in RAM; then nothing is read or taken from slots any more."""
    model, expected, hooks, spans_of, reads, takes = _streamed(folder, tmp_path, monkeypatch)
    reads.available = 10 * AVAILABLE
    left = len(BLOCKS)
    with torch.no_grad():
        for forward in range(6):
            takes.served.clear()
            assert torch.equal(model(IDS).logits, expected), forward
            drain_workers()
            assert not reads.streaming
            served = [name for name in BLOCKS if id(hooks[name]) in takes.served]
            # The first blocks of the order fill the page cache first (the first one may also be read back by
            # the last block's prefetch of the next forward's first module): what comes from slots is a suffix.
            assert served == BLOCKS[len(BLOCKS) - len(served):], forward
            assert len(served) == left if forward == 0 else len(served) <= max(0, left - 3), forward
            assert all(readahead.resident(spans_of[name]) for name in BLOCKS if name not in served), forward
            left = len(served)
    assert left == 0 and not reads.active and reads.direct._slots == []  # all in RAM: the slots are freed


def test_page_cache_fills_found_evicted_hold_off_filling_doubling(folder, tmp_path, monkeypatch):
    """What a forward read into the page cache is gone at the next one (memory pressure, or as here the pages
    released between forwards): the next ``FILL_HOLD`` forwards read every block into slots (each GB filled
    costs CPU time the forward waits for), then a forward fills again; found evicted again, the hold doubles.
    Kept in RAM, the fills go on (the test above)."""
    model, expected, hooks, spans_of, reads, takes = _streamed(folder, tmp_path, monkeypatch)
    reads.available = 10 * AVAILABLE
    monkeypatch.setattr(fills, "FILL_HOLD", 2)
    slotted = []
    with torch.no_grad():
        for forward in range(12):
            takes.served.clear()
            assert torch.equal(model(IDS).logits, expected), forward
            drain_workers()
            slotted.append(sum(id(hooks[name]) in takes.served for name in BLOCKS))
            for spans in spans_of.values():
                readahead.release(spans)
            assert not any(readahead.resident(spans) for spans in spans_of.values()), forward
    # 1: the first forward fills nothing; 2: three blocks filled; 3-4: evicted, a hold of 2; 5: filled;
    # 6-9: evicted again, a hold of 4; 10: filled; 11-12: a hold of 8.
    assert slotted == [10, 7, 10, 10, 7, 10, 10, 10, 10, 7, 10, 10]
    assert reads._fills.hold == 6 and reads._fills.backoff == 8
