"""Loader contracts users of the incumbent rely on.

- a ``.json`` index may be a plain tensor name → shard file mapping (no ``weight_map`` key),
  under any ``.json`` name;
- ``offload_folder`` may be the checkpoint's own folder: the load adds its offload files
  there, never changes a file that was there before (the checkpoint's least of all), and
  refuses, naming the file, when it would have to.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    OffloadedWeightsLoader,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.b.register_buffer("steps", torch.tensor([1, 2]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


X = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 7


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Net().state_dict().items()}


def _meta_net() -> Net:
    with init_empty_weights():
        return Net()


def _reference_output() -> torch.Tensor:
    model = Net()
    model.load_state_dict(_state())
    with torch.no_grad():
        return model(X)


def _shards(folder, fmt: str = "safetensors") -> dict[str, str]:
    """Two shards in ``folder``; returns the name → shard mapping."""
    folder.mkdir(parents=True, exist_ok=True)
    state = _state()
    mapping = {}
    for shard, prefix in ((f"part-a.{fmt}", "a."), (f"part-b.{fmt}", "b.")):
        part = {k: v for k, v in state.items() if k.startswith(prefix)}
        save_file(part, folder / shard) if fmt == "safetensors" else torch.save(part, folder / shard)
        mapping.update(dict.fromkeys(part, shard))
    return mapping


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir() if p.is_file()}


def _assert_loaded(model: nn.Module) -> None:
    state = _state()
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


# ---------------------------------------------------------------- plain-mapping index


@pytest.mark.parametrize("name", ["weights.json", "model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_plain_mapping_json_index_loads(tmp_path, name, fmt):
    mapping = _shards(tmp_path / "ckpt", fmt)
    index = tmp_path / "ckpt" / name
    index.write_text(json.dumps(mapping))
    model = _meta_net()
    load_checkpoint_in_model(model, index, strict=True)
    _assert_loaded(model)


def test_plain_mapping_index_found_in_a_folder(tmp_path):
    mapping = _shards(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps(mapping))
    model = _meta_net()
    load_checkpoint_in_model(model, tmp_path / "ckpt", strict=True)
    _assert_loaded(model)


@pytest.mark.parametrize(
    ("mapping", "message"),
    [
        ({"a.weight": "../part-a.safetensors"}, r"entry 'a\.weight' points to shard '\.\./part-a\.\w+' outside"),
        ({"a.weight": 3}, r"no 'weight_map' and is not a plain .*\(entry 'a\.weight' is 3, not a shard file name\)"),
        ([1, 2], r"weights\.json.* is not a sharded-checkpoint index"),
        ({"weight_map": [1]}, r"'weight_map' must map tensor names to shard file names"),
    ],
)
def test_bad_plain_indexes_are_refused_naming_the_entry(tmp_path, mapping, message):
    _shards(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "weights.json").write_text(json.dumps(mapping))
    model = _meta_net()
    with pytest.raises(ValueError, match=message):
        load_checkpoint_in_model(model, tmp_path / "ckpt" / "weights.json")
    assert all(p.is_meta for p in model.parameters())


# ---------------------------------------------------------------- offload folder = checkpoint folder


@pytest.mark.parametrize("dtype", [None, torch.float16], ids=["in-place", "cast"])
@pytest.mark.parametrize("layout", ["file", "index"])
def test_offload_folder_may_be_the_checkpoint_folder(tmp_path, dtype, layout):
    folder = tmp_path / "ckpt"
    if layout == "file":
        folder.mkdir()
        save_file(_state(), folder / "model.safetensors")
        checkpoint = folder / "model.safetensors"
    else:
        (folder / "x").mkdir(parents=True)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": _shards(folder)}))
        checkpoint = folder
    before = _digests(folder)
    model = load_checkpoint_and_dispatch(
        _meta_net(), str(checkpoint), device_map={"a": "cpu", "b": "disk"}, offload_folder=folder, dtype=dtype
    )
    after = _digests(folder)
    assert {k: after[k] for k in before} == before  # nothing that was there changed
    added = sorted(set(after) - set(before))
    assert added == (["index.json"] if dtype is None else ["b.bias.dat", "b.weight.dat", "index.json"])
    offloaded = OffloadedWeightsLoader(save_folder=folder)
    state = _state()
    for name in ("b.weight", "b.bias"):
        assert torch.equal(offloaded[name], state[name].to(dtype or torch.float32)), name
    if dtype is None:
        with torch.no_grad():
            assert torch.equal(model(X), _reference_output())


def test_loading_again_into_the_checkpoint_folder_reuses_its_own_offload_files(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_state(), folder / "model.safetensors")
    checkpoint_digest = _digests(folder)["model.safetensors"]
    for _ in range(2):
        model = load_checkpoint_and_dispatch(
            _meta_net(), str(folder), device_map={"a": "cpu", "b": "disk"}, offload_folder=folder,
            dtype=torch.float16,
        )  # fmt: skip
    assert _digests(folder)["model.safetensors"] == checkpoint_digest
    assert sorted(p.name for p in folder.iterdir()) == ["b.bias.dat", "b.weight.dat", "index.json", "model.safetensors"]
    assert torch.equal(model.a.weight, _state()["a.weight"].half())
    assert torch.equal(OffloadedWeightsLoader(save_folder=folder)["b.weight"], _state()["b.weight"].half())


@pytest.mark.parametrize(
    ("existing", "content", "message"),
    [
        ("index.json", '{"note": "mine"}', r"index\.json.* already exists in the checkpoint's folder"),
        ("b.weight.dat", "my data", r"b\.weight\.dat.* already exists in the checkpoint's folder"),
    ],
)
def test_files_of_the_checkpoint_folder_are_never_overwritten(tmp_path, existing, content, message):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_state(), folder / "model.safetensors")
    (folder / existing).write_text(content)
    before = _digests(folder)
    model = _meta_net()
    with pytest.raises(ValueError, match=message + r".*pass another offload_folder"):
        load_checkpoint_in_model(
            model, folder, device_map={"a": "cpu", "b": "disk"}, offload_folder=folder, dtype=torch.float16
        )
    assert _digests(folder) == before
    assert sorted(p.name for p in folder.iterdir()) == sorted(before)
    assert all(p.is_meta for p in model.parameters())


def test_a_json_index_named_index_json_is_never_overwritten_by_the_offload_index(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "index.json").parent.mkdir()
    (folder / "index.json").write_text(json.dumps(_shards(folder)))
    before = _digests(folder)
    with pytest.raises(ValueError, match=r"index\.json.* already exists in the checkpoint's folder"):
        load_checkpoint_in_model(
            _meta_net(), folder / "index.json", device_map={"a": "cpu", "b": "disk"}, offload_folder=folder
        )
    assert _digests(folder) == before
