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
from _slot_takes import Takes
from _streamed_llama import AVAILABLE, BLOCKS, IDS, KEPT, MAP, RELEASED

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks.align_hook import loading_hook_of, offload_hook_of
from bigmodel.offload import direct, readahead

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported() or not direct.layout_possible(),
                                reason="needs madvise/mincore, /proc/self/maps and O_DIRECT")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_wide_llama(tmp_path_factory.mktemp("llama"), len(BLOCKS))


def _reference(folder: Path, dtype: torch.dtype = torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


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
        # At most two left: the next pass's first released blocks read back already, or a prefetch's page
        # touching that ran on after its block was released (the forward never waits for it).
        assert len(resident) <= 2, (forward, resident)
        # A release drops no page a kept neighbour shares (blocks lie one after the other in the file).
        assert [name for name in KEPT if not readahead.resident(spans_of[name])] == [], forward


def test_gradients_through_streamed_blocks_equal_the_in_memory_models(folder, tmp_path, monkeypatch):
    reference = _reference(folder)  # its values map the file: freed before the file's pages are dropped
    embeds = reference.model.embed_tokens(IDS).detach().requires_grad_()
    reference(inputs_embeds=embeds).logits.square().sum().backward()
    del reference
    model, _, reads, _ = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.no_grad():
        model(IDS)  # a first pass without gradients: slots read and held
    for _ in range(2):
        mine = embeds.detach().clone().requires_grad_()
        model(inputs_embeds=mine).logits.square().sum().backward()
        assert torch.equal(mine.grad, embeds.grad)
    assert reads.streaming


def test_inference_mode_and_generate_with_a_cache_equal_the_in_memory_model(folder, tmp_path, monkeypatch):
    reference = _reference(folder)
    with torch.no_grad():
        expected = reference.generate(IDS, max_new_tokens=6, do_sample=False, output_scores=True,
                                      return_dict_in_generate=True)
        logits = reference(IDS).logits
    del reference
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.inference_mode():
        for _ in range(3):
            assert torch.equal(model(IDS).logits, logits)
    assert takes.served
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores))
    assert len(reads.direct._slots) <= reads.stream_ahead + 1


def test_a_forward_that_raises_midway_leaks_no_slot(folder, tmp_path, monkeypatch):
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
        first = sorted(takes.served)
        failing = model.get_submodule(BLOCKS[5]).mlp.register_forward_hook(lambda *a: 1 / 0)
        released = {id(hooks[name]) for name in RELEASED}
        for _ in range(3):
            takes.served.clear()
            with pytest.raises(ZeroDivisionError):
                model(IDS)
            # The failed pass's slots (block 5's, its reads ahead) are given back when the next one starts.
            assert released & {id(hooks[name]) for name in BLOCKS[:6]} <= set(takes.served)
        failing.remove()
        for forward in range(4):
            takes.served.clear()
            assert torch.equal(model(IDS).logits, expected), forward
            assert released <= set(takes.served), forward  # slots serve every released block again
            assert set(takes.served) - set(first) == set()
        assert len(reads.direct._slots) <= reads.stream_ahead + 1


def test_an_interrupt_while_a_forward_waits_for_a_direct_read_loses_no_slot(folder, tmp_path, monkeypatch):
    """Ctrl-C lands where a streaming forward mostly is: waiting for a slot's read.  The slot is read into
    again by the next forwards (it was lost for good: fewer blocks read directly after each interrupt)."""
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    released = {id(hooks[name]) for name in RELEASED}
    wait, calls, armed = direct.Reading.wait, [], True

    def interrupted(reading):
        calls.append(reading)
        values = wait(reading)
        if len(calls) == 2 and armed:  # the read is done, Ctrl-C arrives before its values are returned
            raise KeyboardInterrupt
        return values

    monkeypatch.setattr(direct.Reading, "wait", interrupted)
    with torch.no_grad():
        for _ in range(2):
            calls.clear()
            armed = True
            with pytest.raises(KeyboardInterrupt):
                model(IDS)
            armed = False
            for forward in range(2):
                takes.served.clear()
                assert torch.equal(model(IDS).logits, expected), forward
            assert released <= set(takes.served)
    assert len(reads.direct._slots) <= reads.stream_ahead + 1


def test_a_first_forward_that_raises_midway_leaves_no_partial_order(folder, tmp_path, monkeypatch):
    """The first forward records the execution order; raising at block 5, it ran six of the ten blocks.  The
    next forward records it again: every block is read ahead and released (an order of six kept for good
    left blocks 6-9 unread ahead and unreleased, streaming never started)."""
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    failing = model.get_submodule(BLOCKS[5]).register_forward_hook(lambda *a: 1 / 0)
    with torch.no_grad():
        with pytest.raises(ZeroDivisionError):
            model(IDS)
        failing.remove()
        for _ in range(3):
            takes.served.clear()
            assert torch.equal(model(IDS).logits, expected)
    order = next(iter(hooks.values())).prefetcher.order
    assert not order.recording and len(order.refs) == len(BLOCKS)
    assert reads.streaming and {id(hooks[name]) for name in RELEASED} <= set(takes.served)


def test_a_weights_map_value_changed_in_place_between_forwards_is_used(folder, tmp_path, monkeypatch):
    names = ("model.layers.0.mlp.down_proj", "model.layers.5.self_attn.q_proj")
    reference = _reference(folder)
    with torch.no_grad():
        for name in names:
            reference.get_submodule(name).weight.mul_(2)
        expected = reference(IDS).logits
    del reference
    before = _digest(folder)
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.no_grad():
        model(IDS)
        model(IDS)
        for name in names:
            offload_hook_of(model.get_submodule(name)).weights_map["weight"].mul_(2)
        for forward in range(3):
            assert torch.equal(model(IDS).logits, expected), forward
    assert _digest(folder) == before  # the checkpoint is never written


def _digest(folder: Path) -> str:
    import hashlib

    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


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


def test_a_tied_head_on_disk_runs_twice_per_forward_from_slots(tmp_path, monkeypatch):
    """Embeddings and head share one weight (8 MB), both on disk: the one file range is laid out for two
    positions of the order, and the logits stay equal forward after forward."""
    folder = write_wide_llama(tmp_path / "tied", 4, vocab=4096, tied=True, seed=1)
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    layers = [f"model.layers.{i}" for i in range(4)]
    device_map = {"model.embed_tokens": "disk", **dict.fromkeys(layers, "disk"), "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "disk"}
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch, device_map)
    reads.available = 60_000_000
    with torch.no_grad():
        for forward in range(5):
            assert torch.equal(model(IDS).logits, expected), forward
    assert reads.streaming and takes.served


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_stream_bit_identical(tmp_path, monkeypatch, dtype):
    folder = write_wide_llama(tmp_path / "half", 10, seed=2, dtype=dtype)
    with torch.no_grad():
        expected = _reference(folder, dtype)(IDS).logits
    model, _, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch, dtype=dtype)
    reads.available = AVAILABLE // 2
    with torch.no_grad():
        for forward in range(4):
            assert torch.equal(model(IDS).logits, expected), forward
    assert reads.streaming and takes.served


def test_an_offload_folder_of_dat_files_streams_from_slots(folder, tmp_path, monkeypatch):
    """A ``.bin`` checkpoint: the disk blocks are written to an offload folder (one ``.dat`` file per
    tensor) and read from there, several files per module."""
    binary = tmp_path / "bin"
    binary.mkdir()
    shutil.copy(folder / "config.json", binary / "config.json")
    reference = _reference(folder)
    torch.save({key: value.clone() for key, value in reference.state_dict().items()}, binary / "pytorch_model.bin")
    with torch.no_grad():
        expected = reference(IDS).logits
    del reference
    model, hooks, reads, takes = _streamed(binary, tmp_path / "off", monkeypatch)
    assert list((tmp_path / "off").glob("**/*.dat"))
    with torch.no_grad():
        for forward in range(4):
            assert torch.equal(model(IDS).logits, expected), forward
    assert reads.streaming and {id(hooks[name]) for name in RELEASED} <= set(takes.served)


def test_direct_reads_off_then_on_again(folder, tmp_path, monkeypatch):
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    model, hooks, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.no_grad():
        model(IDS)
        monkeypatch.setenv(readahead.DIRECT_ENV, "0")
        reads.reset()
        takes.served.clear()
        for _ in range(2):
            assert torch.equal(model(IDS).logits, expected)
        assert takes.served == []
        monkeypatch.delenv(readahead.DIRECT_ENV)
        reads.reset()
        for _ in range(2):
            assert torch.equal(model(IDS).logits, expected)
        assert takes.served
        assert len(reads.direct._slots) <= reads.stream_ahead + 1


def test_two_threads_forwarding_in_turn_equal_the_in_memory_model(folder, tmp_path, monkeypatch):
    with torch.no_grad():
        expected = _reference(folder)(IDS).logits
    model, _, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    results, turn = [], threading.Lock()

    def run():
        for _ in range(3):
            with turn, torch.no_grad():
                results.append(torch.equal(model(IDS).logits, expected))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [True] * 6 and takes.served


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


def test_a_cast_after_streaming_casts_the_slot_values(folder, tmp_path, monkeypatch):
    with torch.no_grad():
        expected = _reference(folder).to(torch.bfloat16)(IDS).logits
    model, _, reads, takes = _streamed(folder, tmp_path / "off", monkeypatch)
    with torch.no_grad():
        model(IDS)
        model.to(torch.bfloat16)
        for forward in range(3):
            takes.served.clear()
            assert torch.equal(model(IDS).logits, expected), forward
    assert takes.served


def test_one_module_called_several_times_per_forward_albert(tmp_path, monkeypatch):
    """ALBERT runs its one layer group at every layer: a single offloaded module, its hook run six times
    per forward (each run starts a pass of the one-module order)."""
    config = transformers.AlbertConfig(vocab_size=64, embedding_size=128, hidden_size=512, intermediate_size=2048,
                                       num_hidden_layers=6, num_attention_heads=4, num_hidden_groups=1)
    torch.manual_seed(4)
    folder = tmp_path / "albert"
    transformers.AlbertModel(config).eval().save_pretrained(str(folder))
    with torch.no_grad():
        expected = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()(IDS)
    with init_empty_weights():
        model = transformers.AutoModel.from_config(transformers.AutoConfig.from_pretrained(str(folder)))
    model.eval()
    device_map = {"embeddings": "cpu", "encoder.embedding_hidden_mapping_in": "cpu",
                  "encoder.albert_layer_groups.0": "disk", "pooler": "cpu"}
    model = load_checkpoint_and_dispatch(model, str(folder), device_map=device_map, offload_folder=str(tmp_path / "o"))
    hook = loading_hook_of(model.get_submodule("encoder.albert_layer_groups.0"))
    gc.collect()  # the reference's values map the file
    drain_workers()
    drop(folder / "model.safetensors")
    reads = hook.prefetcher.readahead
    reads.window, reads.available = 1, 10_000_000
    reads.direct.fraction = 10.0
    takes = Takes(monkeypatch)
    with torch.no_grad():
        for forward in range(3):
            out = model(IDS)
            assert torch.equal(out.last_hidden_state, expected.last_hidden_state), forward
            assert torch.equal(out.pooler_output, expected.pooler_output), forward
    assert takes.served  # the first runs from a slot (then the one module, kept, is in the page cache)
    assert len(reads.direct._slots) <= reads.stream_ahead + 1
