"""The first forward of a model with layers on disk reads ahead from storage too.

Before any forward has run, the prefetcher follows the order of the modules in the model (a
decoder stack's blocks are registered in the order they run); the first forward records the
actual order, which replaces the guess from the second forward on.  Counted here, never timed:
the spans asked for (``readahead.InOrder.read``, which calls ``madvise(WILLNEED)``) are recorded in order, together with
the start of each block's forward.  From the second forward on (the order recorded), reading ahead
begins when the model's own forward starts, while the embeddings run before the first disk block.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
from _fake_accelerator import drain_workers
from _page_cache import drop, write_wide_llama
from torch import nn

from bigmodel import disk_offload, init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks.align_hook import loading_hook_of
from bigmodel.dispatch import prefetch
from bigmodel.offload import readahead

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported(), reason="needs madvise/mincore and /proc/self/maps")


@pytest.fixture(autouse=True)
def _through_the_page_cache(monkeypatch):
    """These tests follow the page-cache read-ahead (``madvise`` calls); direct reads: test_direct_streaming."""
    monkeypatch.setenv(readahead.DIRECT_ENV, "0")

BLOCKS = [f"model.layers.{i}" for i in range(4)]
MAP = {"model.embed_tokens": "cpu", **dict.fromkeys(BLOCKS, "disk"), "model.norm": "cpu", "model.rotary_emb": "cpu",
       "lm_head": "cpu"}  # fmt: skip
IDS = torch.tensor([[5, 6, 7, 8, 9]])


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A 4-layer Llama (float32 safetensors) whose layers (16 MB each) exceed the kernel's read-around of a page fault."""
    return write_wide_llama(tmp_path_factory.mktemp("llama"), len(BLOCKS))


class Advice:
    """Records, in order, the spans asked for (``InOrder.read``) and the start of each watched module's forward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, modules: dict[str, nn.Module]) -> None:
        self.events: list[tuple[str, object]] = []
        read = readahead.InOrder.read

        def recording(reads, spans, keep=None, **kwargs):
            spans = list(spans)
            self.events.append(("need", spans))
            read(reads, spans, keep, **kwargs)

        monkeypatch.setattr(readahead.InOrder, "read", recording)
        for name, module in modules.items():
            module.register_forward_pre_hook(lambda m, args, name=name: self._started(name))

    def _started(self, name: str) -> None:
        readahead._executor().submit(lambda: None).result()  # what was issued so far has been handed to the kernel
        self.events.append(("start", name))

    def advised_before_each_start(self, spans_of: dict[str, set]) -> list[tuple[str, set[str]]]:
        """(module, the modules whose spans were all advised before its forward started), per start in order."""
        advised: set = set()
        out = []
        for kind, value in self.events:
            if kind == "need":
                advised.update(value)
            else:
                out.append((value, {name for name, spans in spans_of.items() if spans and spans <= advised}))
        return out


def _spans_of(model: nn.Module, names: list[str]) -> dict[str, set]:
    hooks = {name: loading_hook_of(model.get_submodule(name)) for name in names}
    values = {name: hook.prefetcher.read(hook).values() for name, hook in hooks.items()}  # maps the files
    mappings = readahead.file_mappings()
    return {name: set(readahead.file_spans(tensors, mappings)) for name, tensors in values.items()}


def _make_cold(folder: Path, spans_of: dict[str, set]) -> None:
    """Drop the disk blocks' pages from this process and from the page cache; checks they are out."""
    drain_workers()  # a read ahead still running maps the file's pages until it ends: they would not drop
    for spans in spans_of.values():
        readahead.release(spans)
    drop(folder / "model.safetensors")
    assert not any(readahead.resident(sorted(spans)[:1]) for spans in spans_of.values())


def _cold_llama(folder: Path, tmp_path: Path) -> tuple[nn.Module, dict[str, set]]:
    gc.collect()  # an earlier test's model, whose mapping would keep the file's pages
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model.eval()
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(tmp_path / "off"))
    spans_of = _spans_of(model, BLOCKS)
    assert all(spans_of.values())  # the disk blocks are served from the checkpoint's file mapping
    _make_cold(folder, spans_of)
    return model, spans_of


@pytest.mark.parametrize("one_block_window", [False, True])
def test_the_first_forward_reads_the_next_block_ahead_and_values_match(folder, tmp_path, monkeypatch, one_block_window):
    monkeypatch.delenv(readahead.ENV, raising=False)
    model, spans_of = _cold_llama(folder, tmp_path)
    prefetcher = loading_hook_of(model.get_submodule(BLOCKS[0])).prefetcher
    if one_block_window:
        prefetcher.readahead.window = 1  # raised to the largest module's bytes: one block ahead
    advice = Advice(monkeypatch, {name: model.get_submodule(name) for name in BLOCKS})
    with torch.no_grad():
        got = model(IDS).logits
        assert prefetcher.recording  # still the first forward's order
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        expected = reference(IDS).logits
    assert torch.equal(got, expected)
    starts = advice.advised_before_each_start(spans_of)
    assert [name for name, _ in starts] == BLOCKS
    for k, (name, advised) in enumerate(starts[1:], start=1):
        assert name in advised, (name, starts)  # block k's bytes were asked for before block k started
        if one_block_window:
            assert advised == set(BLOCKS[: k + 1]), (name, starts)  # never more than one block ahead
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    assert not prefetcher.recording and prefetcher.order_length == len(BLOCKS)


class Backwards(nn.Module):
    """Linears registered in one order and run in the reverse one (the guess is wrong)."""

    def __init__(self, n: int = 4, dim: int = 256) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def test_a_wrong_guess_is_replaced_by_the_recorded_order(tmp_path, monkeypatch):
    monkeypatch.delenv(readahead.ENV, raising=False)
    torch.manual_seed(0)
    model = Backwards().eval()
    x = torch.randn(2, 256)
    with torch.no_grad():
        expected = model(x)
    disk_offload(model, tmp_path / "off", execution_device="cpu")
    names = [f"layers.{i}" for i in range(4)]
    run_order = names[::-1]
    spans_of = _spans_of(model, names)
    prefetcher = model.layers[0]._hf_hook.prefetcher
    prefetcher.readahead.window = 1  # one layer ahead
    advice = Advice(monkeypatch, {name: model.get_submodule(name) for name in names})
    for name in os.listdir(tmp_path / "off"):
        if name.endswith(".dat"):
            drop(tmp_path / "off" / name)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
        assert [id(ref()) for ref in prefetcher.order.refs] == [id(layer._hf_hook) for layer in model.layers]
        advice.events.clear()
        for spans in spans_of.values():
            readahead.release(spans)
        for name in os.listdir(tmp_path / "off"):
            if name.endswith(".dat"):
                drop(tmp_path / "off" / name)
        assert torch.equal(model(x), expected)  # the recorded order replaces the guess
    assert [id(ref()) for ref in prefetcher.order.refs] == [id(model.get_submodule(n)._hf_hook) for n in run_order]
    starts = advice.advised_before_each_start(spans_of)
    assert [name for name, _ in starts] == run_order
    for k, (name, advised) in enumerate(starts[1:], start=1):
        assert advised == set(run_order[: k + 1]), (name, starts)


@pytest.mark.parametrize("warm", [0, 1, 2, 4], ids=["first-forward", "second-forward", "order-recorded", "quiet"])
def test_reading_ahead_begins_when_the_models_forward_starts(folder, tmp_path, monkeypatch, warm):
    """Also after warm forwards that found nothing to read ahead, whose followers skip the prefetch work
    (``Prefetcher.quiet``): the first disk block's first page, out of RAM, ends the quiet forwards."""
    monkeypatch.delenv(readahead.ENV, raising=False)
    model, spans_of = _cold_llama(folder, tmp_path)
    prefetcher = model._hf_hook.prefetcher
    with torch.no_grad():
        for _ in range(warm):  # the second forward's start ends the recording of the order
            model(IDS)
        assert prefetcher.recording == (warm <= 1)
        assert prefetcher.quiet == (warm > 3)
        if warm:
            _make_cold(folder, spans_of)
    advice = Advice(monkeypatch, {"embed": model.model.embed_tokens, **{name: model.get_submodule(name) for name in BLOCKS}})
    with torch.no_grad():
        got = model(IDS).logits
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        assert torch.equal(got, reference(IDS).logits)
    starts = advice.advised_before_each_start(spans_of)
    assert [name for name, _ in starts] == ["embed", *BLOCKS]
    assert BLOCKS[0] in starts[0][1], starts  # the first disk block was asked for before the embeddings ran
    assert len([kind for kind, _ in advice.events if kind == "need"]) == len(BLOCKS)  # once each: one pass


def test_quiet_forwards_skip_the_prefetch_work_and_match(folder, tmp_path, monkeypatch):
    """A warm forward that found nothing to stage or read ahead is followed by ``QUIET_FORWARDS`` forwards
    whose block hooks call neither ``take`` nor ``schedule_after``; then one checks everything again."""
    monkeypatch.delenv(readahead.ENV, raising=False)
    model, _ = _cold_llama(folder, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    calls: list[str] = []
    for name in ("take", "schedule_after"):
        real = getattr(prefetch.Prefetcher, name)
        monkeypatch.setattr(prefetch.Prefetcher, name, lambda self, *a, real=real, name=name, **k: calls.append(name)
                            or real(self, *a, **k))
    prefetcher = model._hf_hook.prefetcher
    per_forward = []
    with torch.no_grad():
        expected = reference(IDS).logits
        for _ in range(3 + 2 * prefetch.RECHECK_EVERY):
            calls.clear()
            assert torch.equal(model(IDS).logits, expected)
            per_forward.append((prefetcher.quiet, len(calls)))
    assert [quiet for quiet, _ in per_forward[:2]] == [False] * 2  # recording; the order replaced at the start, checked
    assert all(n == (0 if quiet else 2 * len(BLOCKS)) for quiet, n in per_forward), per_forward
    runs = "".join("q" if quiet else "c" for quiet, _ in per_forward[1:])
    assert runs.startswith("c" + "q" * prefetch.QUIET_FORWARDS + "c" + "q" * prefetch.QUIET_FORWARDS), runs
    prefetcher.invalidate()  # a weights map changed: the next forward checks again
    assert not prefetcher.quiet
