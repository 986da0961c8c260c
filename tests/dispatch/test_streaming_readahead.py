"""Streaming a model whose disk part exceeds the page cache: which modules stay, who releases, reading on.

When the offloaded bytes do not fit in the available memory, :class:`bigmodel.offload.readahead.ReadAhead`
releases each module once it has run, except modules spread evenly over the execution order
(``spread_kept``), so that a kept module computes while the disk reads the next released one.  The
releases run on their own thread (on the reading thread, a release's CPU time left the disk idle), and
the end of a pass reads the next pass's first released module back (the disk no longer waits for the
next forward to start).  Counted, never timed: the ``will_need`` and ``release`` calls are recorded with
the thread that made them, and logits are compared with the model's own in-memory forward.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
import torch
from _fake_accelerator import drain_workers
from _page_cache import drop, write_wide_llama
from _streamed_llama import AVAILABLE, BLOCKS, IDS, KEPT, MAP

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks.align_hook import loading_hook_of
from bigmodel.offload import in_order, readahead

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported(), reason="needs madvise/mincore and /proc/self/maps")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_wide_llama(tmp_path_factory.mktemp("llama"), len(BLOCKS))


def test_spread_kept_spaces_equal_modules_evenly_and_fills_with_what_fits():
    assert [i for i, kept in enumerate(readahead.spread_kept([10] * 8, 25)) if kept] == [2, 6]
    assert [i for i, kept in enumerate(readahead.spread_kept([10] * 30, 120)) if kept] == [1, 3, 6, 8, 11, 13, 16,
                                                                                          18, 21, 23, 26, 28]
    assert readahead.spread_kept([10] * 4, 0) == [False] * 4
    assert readahead.spread_kept([10] * 4, 40) == [True] * 4
    # The evenly spaced ones (the large) do not fit: the small ones that do are kept instead.
    assert readahead.spread_kept([1, 100, 1, 100, 1, 100], 3) == [True, False, True, False, True, False]
    assert readahead.spread_kept([], 10) == []


class Calls:
    """Records ``("need" | "release", spans, thread name)`` for every span advised or released, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, tuple, str]] = []
        self._lock = threading.Lock()
        will_need, release = readahead.will_need, readahead.release

        def needing(spans):
            spans = list(spans)
            self._record("need", spans)
            will_need(spans)

        def releasing(spans):
            spans = list(spans)
            self._record("release", spans)
            release(spans)

        monkeypatch.setattr(in_order, "will_need", needing)
        monkeypatch.setattr(readahead, "release", releasing)

    def _record(self, kind: str, spans: list) -> None:
        with self._lock:
            self.events.extend((kind, span, threading.current_thread().name) for span in spans)


def _reference(folder: Path) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(IDS).logits


def _arrives(spans: set[tuple[int, int]], seconds: float = 5.0) -> bool:
    """True once the spans' first and last pages are in RAM, waiting up to ``seconds`` (advised reads
    are asynchronous: the last pieces asked for may still be on their way when the jobs are done)."""
    deadline = time.monotonic() + seconds
    while not readahead.resident(spans):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _owners(spans_of: dict[str, set[tuple[int, int]]], span: tuple[int, int]) -> set[str]:
    """The modules one of whose spans holds ``span`` (a released span is the pages wholly inside one block's
    tensors: the page it shares with the block before or after it is never released)."""
    lo, length = span
    return {name for name, spans in spans_of.items()
            if min(start for start, _ in spans) <= lo and lo + length <= max(start + size for start, size in spans)}


def _streamed(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: int | None):
    """(model, its in-memory logits, block name -> spans, its ReadAhead, recorded calls): the model loaded
    with the disk blocks cold and a page cache too small for them, reading ``ahead`` blocks ahead (None:
    the default)."""
    monkeypatch.delenv(readahead.ENV, raising=False)
    monkeypatch.setenv(readahead.DIRECT_ENV, "0")  # the page-cache path (direct reads: test_direct_streaming)
    gc.collect()
    config = transformers.AutoConfig.from_pretrained(str(folder))
    expected = _reference(folder)
    gc.collect()  # the reference's mapping of the file: a page mapped twice is not released
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"))
    hooks = {name: loading_hook_of(model.get_submodule(name)) for name in BLOCKS}
    values_of = {name: hook.prefetcher.read(hook).values() for name, hook in hooks.items()}
    mappings = readahead.file_mappings()
    spans_of = {name: set(readahead.file_spans(values, mappings)) for name, values in values_of.items()}
    assert all(spans_of.values())  # the disk blocks are views of the checkpoint's mapping
    drain_workers()
    drop(folder / "model.safetensors")
    reads = hooks[BLOCKS[0]].prefetcher.readahead
    reads.window, reads.available = 1, AVAILABLE  # at least one block; a page cache too small for the disk part
    if ahead is not None:
        reads.stream_ahead = ahead
    return model, expected, spans_of, reads, Calls(monkeypatch)


def _asked_after_release(calls: Calls, spans_of: dict[str, set[tuple[int, int]]], name: str) -> bool:
    """True if every piece of block ``name`` was asked for after its last release."""
    releases = [i for i, (kind, span, _) in enumerate(calls.events)
                if kind == "release" and name in _owners(spans_of, span)]
    asked = {span for kind, span, _ in calls.events[max(releases):] if kind == "need"}
    return {piece for span in spans_of[name] for piece in readahead.pieces(span)} <= asked


def test_streaming_reads_two_released_blocks_ahead(folder, tmp_path, monkeypatch):
    """By default the end of a pass reads on into the next pass's first *two* released blocks (with the
    kept block between them), where one block ahead reads only the first."""
    first, second = [name for name in BLOCKS if name not in KEPT][:2]
    for ahead, read_back in ((None, [True, True]), (1, [True, False])):
        model, expected, spans_of, reads, calls = _streamed(folder, tmp_path / str(ahead), monkeypatch, ahead)
        with torch.no_grad():
            for _ in range(2):
                calls.events.clear()
                assert torch.equal(model(IDS).logits, expected)
                drain_workers()
                assert reads._reach == (ahead or 2) * max(reads._bytes)
                assert [_asked_after_release(calls, spans_of, name) for name in (first, second)] == read_back
        del model
        monkeypatch.undo()


def test_streaming_keeps_spread_modules_releases_on_its_own_thread_and_reads_the_next_pass_on(
        folder, tmp_path, monkeypatch):  # fmt: skip
    model, expected, spans_of, reads, calls = _streamed(folder, tmp_path, monkeypatch, ahead=1)
    with torch.no_grad():
        for forward in range(3):
            assert torch.equal(model(IDS).logits, expected)
            drain_workers()
            assert reads.streaming
            assert [name for name, k in zip(BLOCKS, reads._kept) if k] == KEPT  # spread, not the first ones
            releases = [(i, span, thread) for i, (kind, span, thread) in enumerate(calls.events) if kind == "release"]
            released = set().union(*(_owners(spans_of, span) for _, span, _ in releases))
            assert released == set(BLOCKS) - set(KEPT), forward
            assert {thread.rsplit("_", 1)[0] for _, _, thread in releases} == {"bigmodel-release"}
            # The pass's end read the first released block of the next pass back, after releasing it.
            first = BLOCKS[0]
            last_release = max(i for i, span, _ in releases if first in _owners(spans_of, span))
            read_back = {span for kind, span, _ in calls.events[last_release:] if kind == "need"}
            assert {piece for span in spans_of[first] for piece in readahead.pieces(span)} <= read_back
            assert _arrives(spans_of[first])  # asked for last: the kernel's reads may still be in flight
            # Reads still queued for a released block are dropped: none of its pieces is asked for after its
            # release (but the first block's, read back for the next forward).
            for name in sorted(released - {first}):
                pieces = {piece for span in spans_of[name] for piece in readahead.pieces(span)}
                last = max(i for i, span, _ in releases if name in _owners(spans_of, span))
                assert not pieces & {span for kind, span, _ in calls.events[last:] if kind == "need"}, (forward, name)
            calls.events.clear()
