"""Checkpoints in the Hugging Face hub cache layout load bit-exactly; links leaving the repo folder are refused.

``huggingface_hub`` stores a repo as ``models--org--name/blobs/<sha256>`` (the bytes) and
``models--org--name/snapshots/<revision>/<file name>`` (relative symbolic links
``../../blobs/<sha256>``).  The layout is built here with real links around a tiny Llama
saved by transformers, as safetensors and as torch ``.bin``, single file and sharded.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _tiny_hf import write_tiny_llama  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bigmodel import (  # noqa: E402
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    load_pretrained,
)

IDS = torch.tensor([[3, 9, 4, 20, 7, 11]])
REVISION = "0123456789abcdef0123456789abcdef01234567"
LAYOUTS = ["safetensors", "safetensors-sharded", "bin", "bin-sharded"]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder saved by transformers (config, safetensors, tokenizer)."""
    return write_tiny_llama(tmp_path_factory.mktemp("hub-src") / "model")


@pytest.fixture(scope="module")
def reference(source: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The state dict and logits of the model loaded whole by transformers."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(IDS).logits
    return {k: v.clone() for k, v in model.state_dict().items()}, logits


def _weight_files(source: Path, layout: str, staging: Path) -> dict[str, bytes]:
    """File name → bytes of the weights in ``layout`` (sharded: two shards and an index)."""
    from safetensors.torch import load_file

    state = load_file(source / "model.safetensors")
    staging.mkdir(parents=True, exist_ok=True)
    binary = layout.startswith("bin")
    if not layout.endswith("sharded"):
        name = "pytorch_model.bin" if binary else "model.safetensors"
        path = staging / name
        torch.save(state, path) if binary else save_file(state, path, metadata={"format": "pt"})
        return {name: path.read_bytes()}
    suffix = "bin" if binary else "safetensors"
    names = sorted(state)
    halves = {f"model-0000{i + 1}-of-00002.{suffix}": names[i::2] for i in range(2)}
    files, weight_map = {}, {}
    for shard, keys in halves.items():
        part = {k: state[k] for k in keys}
        path = staging / shard
        torch.save(part, path) if binary else save_file(part, path, metadata={"format": "pt"})
        files[shard] = path.read_bytes()
        weight_map.update(dict.fromkeys(keys, shard))
    index = "pytorch_model.bin.index.json" if binary else "model.safetensors.index.json"
    files[index] = json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}).encode()
    return files


def make_hub_repo(cache: Path, source: Path, layout: str, repo: str = "models--tiny-org--tiny-llama") -> Path:
    """Build ``cache/<repo>`` as huggingface_hub does; returns the snapshot folder."""
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file() and not p.name.startswith("model")}
    files.update(_weight_files(source, layout, cache / f".staging-{layout}"))
    root = cache / repo
    snapshot = root / "snapshots" / REVISION
    (root / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (root / "blobs" / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snapshot / name)
    return snapshot


def _weights_name(layout: str) -> str:
    binary = layout.startswith("bin")
    if layout.endswith("sharded"):
        return "pytorch_model.bin.index.json" if binary else "model.safetensors.index.json"
    return "pytorch_model.bin" if binary else "model.safetensors"


def _empty(source: Path) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(str(source))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _blob_digests(snapshot: Path) -> dict[str, str]:
    blobs = snapshot.parent.parent / "blobs"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in blobs.iterdir()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("target", ["folder", "file"])
def test_load_checkpoint_in_model_reads_a_hub_snapshot_bit_exact(source, reference, tmp_path, layout, target):
    snapshot = make_hub_repo(tmp_path, source, layout)
    assert all(p.is_symlink() for p in snapshot.iterdir())
    model = _empty(source)
    checkpoint = snapshot if target == "folder" else snapshot / _weights_name(layout)
    load_checkpoint_in_model(model, checkpoint, strict=True)
    expected, _ = reference
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for name, value in expected.items():
        assert state[name].device.type == "cpu"
        assert torch.equal(state[name], value), name


@pytest.mark.parametrize("layout", ["safetensors-sharded", "bin"])
def test_load_checkpoint_and_dispatch_with_disk_from_a_hub_snapshot(source, reference, tmp_path, layout):
    snapshot = make_hub_repo(tmp_path / "hub", source, layout)
    before = _blob_digests(snapshot)
    model = _empty(source)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "disk",
                  "model.rotary_emb": "cpu", "lm_head": "disk"}  # fmt: skip
    offload = tmp_path / "offload"
    model = load_checkpoint_and_dispatch(model, str(snapshot), device_map=device_map, offload_folder=offload)
    with torch.no_grad():
        logits = model(IDS).logits
    assert torch.equal(logits, reference[1])
    assert (offload / "index.json").is_file()
    assert _blob_digests(snapshot) == before  # the cache is never written


@pytest.mark.parametrize("layout", ["safetensors", "bin-sharded"])
def test_load_pretrained_from_a_hub_snapshot(source, reference, tmp_path, layout):
    snapshot = make_hub_repo(tmp_path / "hub", source, layout)
    model = load_pretrained(snapshot, max_memory={"cpu": 60_000}, offload_folder=tmp_path / "offload")
    assert "disk" in model.hf_device_map.values()
    with torch.no_grad():
        logits = model(IDS).logits
    assert torch.equal(logits, reference[1])


def test_cli_generates_from_a_hub_snapshot_and_checks_it(source, tmp_path):
    snapshot = make_hub_repo(tmp_path / "hub", source, "safetensors-sharded")
    result = subprocess.run(
        [sys.executable, "-m", "bigmodel.cli.main", "generate", str(snapshot), "--prompt", "w1 w2",
         "--max-new-tokens", "3", "--max-memory", "cpu=60KB", "--no-chat", "--check"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "BIGMODEL_DEBUG": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "vs the model loaded whole in memory: identical" in result.stdout
    assert "disk" in result.stdout


# ---------------------------------------------------------------- still refused


def _relink(link: Path, target: str | Path) -> None:
    link.unlink()
    os.symlink(target, link)


def _copy_blob_to(snapshot: Path, name: str, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes((snapshot / name).read_bytes())


LINKS_OUT = r"model-00001-of-00002\.safetensors' \(shard of entry '.+'\) links to '.+', outside the hub repo folder"


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("absolute-entry", r"entry '.+' points to shard '/.+' outside the checkpoint folder"),
        ("climbing-entry", r"entry '.+' points to shard '\.\./\.\./blobs/.+' outside the checkpoint folder"),
        ("link-out-of-repo", LINKS_OUT + r" '.*/models--tiny-org--tiny-llama'"),
        ("link-into-other-repo", LINKS_OUT),
        ("absolute-link-out", LINKS_OUT),
    ],
)  # fmt: skip
def test_escaping_index_entries_and_links_are_refused_naming_the_file(source, tmp_path, case, message):
    snapshot = make_hub_repo(tmp_path / "hub", source, "safetensors-sharded")
    shard = "model-00001-of-00002.safetensors"
    index_file = snapshot / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    blob = os.readlink(snapshot / shard)
    if case in ("absolute-entry", "climbing-entry"):
        new = str((snapshot / shard).resolve()) if case == "absolute-entry" else blob
        index["weight_map"] = {k: (new if v == shard else v) for k, v in index["weight_map"].items()}
        edited = snapshot.parent.parent / "blobs" / "edited-index"
        edited.write_text(json.dumps(index))
        _relink(index_file, "../../blobs/edited-index")
    elif case == "link-out-of-repo":
        _copy_blob_to(snapshot, shard, tmp_path / "elsewhere" / "blob")
        _relink(snapshot / shard, "../../../../elsewhere/blob")
    elif case == "link-into-other-repo":
        other = tmp_path / "hub" / "models--someone--else" / "blobs" / "abc"
        _copy_blob_to(snapshot, shard, other)
        _relink(snapshot / shard, "../../../models--someone--else/blobs/abc")
    else:
        _copy_blob_to(snapshot, shard, tmp_path / "elsewhere" / "blob")
        _relink(snapshot / shard, tmp_path / "elsewhere" / "blob")
    model = _empty(source)
    with pytest.raises(ValueError, match=message):
        load_checkpoint_in_model(model, snapshot)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_single_file_linking_out_of_the_repo_is_refused(source, tmp_path):
    snapshot = make_hub_repo(tmp_path / "hub", source, "safetensors")
    _copy_blob_to(snapshot, "model.safetensors", tmp_path / "elsewhere" / "blob.safetensors")
    _relink(snapshot / "model.safetensors", tmp_path / "elsewhere" / "blob.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors.* links to .*outside the hub repo folder"):
        load_checkpoint_in_model(_empty(source), snapshot)


def test_plain_folder_shards_still_may_not_link_out(source, tmp_path):
    """Outside the hub layout the rule is unchanged: shards resolve inside the index's folder."""
    snapshot = make_hub_repo(tmp_path / "hub", source, "safetensors-sharded")
    plain = tmp_path / "plain"
    plain.mkdir()
    for link in snapshot.iterdir():
        os.symlink(link.resolve(), plain / link.name)
    with pytest.raises(ValueError, match=r"resolves outside the checkpoint folder"):
        load_checkpoint_in_model(_empty(source), plain)


@pytest.mark.parametrize("layout", ["safetensors", "safetensors-sharded"])
def test_a_repo_folder_linked_to_a_folder_named_otherwise_loads(source, reference, tmp_path, layout):
    """``models--org--name`` a symlink to ``/bigdisk/llama-tiny`` (a cache moved to a larger disk): the snapshot's
    blobs lie inside the linked repo folder, so its shards load as transformers loads them (sharded ones were
    refused as resolving outside the checkpoint folder)."""
    snapshot = make_hub_repo(tmp_path / "hub", source, layout)
    repo = snapshot.parent.parent
    moved = tmp_path / "bigdisk" / "llama-tiny"
    moved.parent.mkdir()
    repo.rename(moved)
    os.symlink(moved, repo)
    model = _empty(source)
    load_checkpoint_in_model(model, snapshot, strict=True)
    expected, _ = reference
    assert all(torch.equal(model.state_dict()[name], value) for name, value in expected.items())
    name = "model-00001-of-00002.safetensors" if layout == "safetensors-sharded" else "model.safetensors"
    _copy_blob_to(snapshot, name, tmp_path / "bigdisk" / "elsewhere")  # a link out of the linked repo: refused
    _relink(snapshot / name, tmp_path / "bigdisk" / "elsewhere")
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + r".* links to .*outside the hub repo folder"):
        load_checkpoint_in_model(_empty(source), snapshot)
