"""Streaming read-ahead (released modules, kept ones) on a checkpoint in the Hugging Face hub cache layout.

The read-ahead releases the pages of used disk modules only when the offloaded bytes exceed what memory
can cache; here the available-memory figure is made small (as tests/dispatch/test_streaming_readahead.py
does) so that a 6-layer Llama streams.  Its disk layers are read in place from the cache's blobs
(safetensors, through the snapshot's links) or from the offload folder's ``.dat`` files (a ``.bin``
checkpoint).  Every forward and ``generate`` equals the model transformers loads whole in memory from the
same snapshot (the same values at the same alignment: one-token matmuls on some CPUs, AMD EPYC with MKL
here, round differently for a weight 8 but not 16 bytes aligned, as safetensors' can be), across input lengths, a
second thread, and a re-dispatch after ``remove_hook_from_submodules``; the blobs and the snapshot are
left as they were.
"""

from __future__ import annotations

import gc
import hashlib
import threading
from pathlib import Path

import pytest
import torch
from _fake_accelerator import drain_workers
from _page_cache import drop
from _tiny_hf import hub_snapshot

from bigmodel import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.hooks import remove_hook_from_submodules
from bigmodel.hooks.align_hook import loading_hook_of
from bigmodel.offload import readahead

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not readahead.supported(), reason="needs madvise/mincore and /proc/self/maps")

LAYERS = 6
MAP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
       **{f"model.layers.{i}": "cpu" if i == 3 else "disk" for i in range(LAYERS)}}  # fmt: skip
# 5 disk layers of 9.4 MB: 47 MB offloaded > 0.8 x 50 MB (streaming).
AVAILABLE = 50_000_000


def _config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def whole() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(_config()).to(torch.float32).eval()


def _snapshot(root: Path, whole: torch.nn.Module, binary: bool) -> Path:
    source = root / "source"
    whole.save_pretrained(str(source), max_shard_size="20MB")
    if binary:
        for shard in [*source.glob("*.safetensors"), source / "model.safetensors.index.json"]:
            shard.unlink()  # one .bin file instead of the shards
        torch.save(whole.state_dict(), source / "pytorch_model.bin")
    return hub_snapshot(root / "hub", source)


def _state(snapshot: Path) -> tuple[dict[str, str], list[str]]:
    blobs = snapshot.parents[1] / "blobs"
    return ({p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in blobs.iterdir()},
            sorted(p.name for p in snapshot.iterdir()))  # fmt: skip


def _drop_all(*folders: Path) -> None:
    drain_workers()
    for folder in folders:
        for path in folder.iterdir() if folder.is_dir() else ():
            drop(path)


def _streams(model: torch.nn.Module) -> readahead.ReadAhead:
    hook = next(hook for module in model.modules() if (hook := loading_hook_of(module)) is not None)
    reads = hook.prefetcher.readahead
    reads.window = 1  # one module ahead: some modules fit in the memory kept between forwards
    return reads


def _loaded_outputs(snapshot: Path, inputs: dict[int, torch.Tensor], ids: torch.Tensor):
    """Logits per input length and greedy tokens for ``ids`` of the model transformers loads from ``snapshot``,
    computed before streaming starts: its mapping of the blobs is gone then (a page mapped twice stays)."""
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(snapshot)).eval()
    with torch.no_grad():
        references = {n: loaded(x).logits for n, x in inputs.items()}
    tokens = loaded.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    del loaded
    gc.collect()
    return references, tokens


@pytest.mark.parametrize("binary", [False, True], ids=["safetensors-blobs", "bin-dat-files"])
def test_streaming_forwards_and_generate_equal_the_whole_model(whole, binary, tmp_path, monkeypatch):
    monkeypatch.delenv(readahead.ENV, raising=False)
    monkeypatch.setattr(readahead, "available_memory", lambda: AVAILABLE)
    snapshot = _snapshot(tmp_path, whole, binary)
    before = _state(snapshot)
    blobs, offload = snapshot.parents[1] / "blobs", tmp_path / "off"
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(_config()).eval()
    model = load_checkpoint_and_dispatch(model, str(snapshot), device_map=MAP, offload_folder=str(offload))
    assert any(offload.glob("*.dat")) == binary  # safetensors: read in place from the blobs
    reads, generator = _streams(model), torch.Generator().manual_seed(0)
    inputs = {n: torch.randint(0, 64, (1, n), generator=generator) for n in (5, 17, 1, 9, 6, 13, 4, 11)}
    ids = torch.randint(0, 64, (2, 6), generator=generator)
    references, expected = _loaded_outputs(snapshot, inputs, ids)

    def same(length: int) -> bool:
        _drop_all(blobs, offload, tmp_path / "again")
        with torch.no_grad():
            return torch.equal(model(inputs[length]).logits, references[length])

    assert all(same(length) for length in (5, 17, 1, 9))
    assert reads.streaming and not all(reads._kept)
    _drop_all(blobs, offload)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0), expected)
    results: list[bool] = []
    for length in (6, 13):  # from another thread, one call after the other
        thread = threading.Thread(target=lambda n=length: results.append(same(n)))
        thread.start()
        thread.join()
    assert results == [True, True]
    remove_hook_from_submodules(model)
    model = dispatch_model(model, {**MAP, "model.layers.0": "cpu", "model.layers.3": "disk"},
                           offload_dir=str(tmp_path / "again"))  # fmt: skip
    _streams(model)
    assert all(same(length) for length in (4, 11))
    drain_workers()
    assert _state(snapshot) == before
