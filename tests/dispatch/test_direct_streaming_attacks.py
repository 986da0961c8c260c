"""Streaming with direct reads (offload.direct) under the conditions most likely to break it.

Each test forces streaming with direct reads on a tiny transformers Llama saved as real files (as
test_direct_streaming does: ``window = 1``, a small ``available``, ``direct.fraction = 1.0``) and compares
logits, generated tokens or gradients with transformers' own in-memory model of the same files.  Counted,
never timed.
"""

from __future__ import annotations

import gc
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from _fake_accelerator import drain_workers
from _page_cache import drop, write_wide_llama

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks.align_hook import loading_hook_of, offload_hook_of
from bigmodel.offload import direct, readahead

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported() or not direct.layout_possible(),
                                reason="needs madvise/mincore, /proc/self/maps and O_DIRECT")

BLOCKS = [f"model.layers.{i}" for i in range(10)]
MAP = {"model.embed_tokens": "cpu", **dict.fromkeys(BLOCKS, "disk"), "model.norm": "cpu", "model.rotary_emb": "cpu",
       "lm_head": "cpu"}  # fmt: skip
IDS = torch.tensor([[5, 6, 7, 8, 9]])
AVAILABLE = 180_000_000  # as in test_streaming_readahead: kept blocks 1, 4, 7 and 9
KEPT = ["model.layers.1", "model.layers.4", "model.layers.7", "model.layers.9"]
RELEASED = [name for name in BLOCKS if name not in KEPT]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_wide_llama(tmp_path_factory.mktemp("llama"), len(BLOCKS))


def _reference(folder: Path, dtype: torch.dtype = torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


class Takes:
    """Counts, per hook id, the values taken from slots."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.served: list[int] = []
        take = direct.Streams.take

        def taking(streams, key):
            values = take(streams, key)
            if values is not None:
                self.served.append(key)
            return values

        monkeypatch.setattr(direct.Streams, "take", taking)


def _streamed(folder: Path, offload: Path, monkeypatch: pytest.MonkeyPatch, device_map: dict = MAP,
              dtype: torch.dtype | None = None):
    """The model dispatched from ``folder`` with direct streaming forced; (model, hooks, reads, takes)."""
    monkeypatch.delenv(readahead.ENV, raising=False)
    monkeypatch.delenv(readahead.DIRECT_ENV, raising=False)
    gc.collect()
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    model.eval()
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=device_map, offload_folder=str(offload),
                                         dtype=dtype)
    hooks = {name: loading_hook_of(model.get_submodule(name)) for name, where in device_map.items() if where == "disk"}
    drain_workers()
    for path in list(folder.glob("*.safetensors")) + list(folder.glob("*.bin")) + list(offload.glob("**/*.dat")):
        drop(path)
    reads = next(iter(hooks.values())).prefetcher.readahead
    reads.window, reads.available = 1, AVAILABLE
    reads.direct.fraction = 1.0
    return model, hooks, reads, Takes(monkeypatch)


def _spans(hooks: dict) -> dict:
    values_of = {name: hook.prefetcher.read(hook).values() for name, hook in hooks.items()}
    mappings = readahead.file_mappings()
    return {name: readahead.file_spans(values, mappings) for name, values in values_of.items()}


def test_with_gradients_the_released_blocks_are_still_released(folder, tmp_path, monkeypatch):
    """Recording gradients, the hooks use their mapped views: the blocks' pages are read through the page
    cache, and the released ones must leave it after they ran (as without direct reads)."""
    expected = _reference(folder)(IDS).logits.detach()
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    spans_of = _spans(hooks)
    for forward in range(2):
        assert torch.equal(model(IDS).logits.detach(), expected), forward
        drain_workers()
        assert reads.streaming and takes.served == []
        resident = [name for name in RELEASED if readahead.resident(spans_of[name])]
        # The next pass's first released blocks may be read back already (within the read-ahead reach).
        assert len(resident) <= 2 and resident == RELEASED[:len(resident)], (forward, resident)


def _threads(prefix: str) -> int:
    return sum(1 for thread in threading.enumerate() if thread.name.startswith(prefix))


def _open_under(path: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


def test_models_deleted_and_loaded_again_leave_no_descriptors_or_threads(folder, tmp_path, monkeypatch):
    """Three models streamed one after the other from their own copies of the checkpoint, each deleted
    (and its folder removed) before the next: no descriptor of a removed file stays open, no reader
    threads pile up."""
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    gc.collect()
    before = _threads("bigmodel-direct")
    for i in range(3):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(folder, copy)
        model, _, reads, _ = _streamed(copy, tmp_path / f"off{i}", monkeypatch)
        with torch.no_grad():
            for _ in range(2):
                assert torch.equal(model(IDS).logits, expected)
        assert torch.equal(model(IDS).logits.detach(), expected)  # with gradients: the page-cache path (drop)
        drain_workers()
        del model, reads
        gc.collect()
        drain_workers()
        shutil.rmtree(copy)
        assert _open_under(copy) == [], i
        for _ in range(100):  # a freed pool's threads exit on their own, soon after
            if _threads("bigmodel-direct") <= before:
                break
            time.sleep(0.05)
        assert _threads("bigmodel-direct") <= before, i


def test_modules_staged_for_an_accelerator_are_not_read_into_slots(folder, tmp_path, monkeypatch):
    """Hooks staged by a DeviceStager (an accelerator, here the simulated one) never take a slot's views:
    reading their modules into slots too would read every streamed byte twice."""
    from _fake_accelerator import dispatch_as_accelerator, install

    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    install(monkeypatch)
    dispatch_as_accelerator(monkeypatch)
    readings = []
    read = direct.Reader.read
    monkeypatch.setattr(direct.Reader, "read", lambda reader, plan, slot: readings.append(plan) or read(reader, plan, slot))
    model, _, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.no_grad():
        for forward in range(3):
            assert torch.equal(model(IDS).logits, expected), forward
    drain_workers()
    assert reads.streaming and takes.served == [] and readings == []
