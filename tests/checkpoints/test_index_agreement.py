"""A sharded checkpoint's index that puts a tensor in a shard whose header lacks it: a warning naming
both, and the tensor loaded from the shard that holds it (transformers and the incumbent load every
tensor of every indexed shard, so such a checkpoint works there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import load_checkpoint_and_dispatch
from bigmodel.checkpoints.files import read_tensor_infos, resolve_checkpoint_files


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))


def _shards(folder: Path, weight_map: dict[str, str], in_a: tuple[str, ...] = ("0.weight", "0.bias", "2.bias")) -> Path:
    """``in_a`` saved in a.safetensors, the rest of the state dict in b.safetensors, and an index with ``weight_map``."""
    state = _net().state_dict()
    save_file({k: v for k, v in state.items() if k in in_a}, folder / "a.safetensors")
    save_file({k: v for k, v in state.items() if k not in in_a}, folder / "b.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


TRUE_MAP = {"0.weight": "a.safetensors", "0.bias": "a.safetensors", "2.bias": "a.safetensors",
            "2.weight": "b.safetensors"}  # fmt: skip


def test_a_tensor_in_another_shard_than_the_index_says_is_named_and_loaded(tmp_path: Path) -> None:
    index = _shards(tmp_path, {**TRUE_MAP, "2.bias": "b.safetensors"})
    message = (r"index in .* and its shards disagree on 1 tensor\(s\): '2\.bias' \(indexed in 'b\.safetensors', "
               r"read from 'a\.safetensors'\); regenerate the index")  # fmt: skip
    with pytest.warns(UserWarning, match=message) as caught:
        infos = read_tensor_infos(resolve_checkpoint_files(index))
    assert infos["2.bias"].file.name == "a.safetensors"
    assert [w.filename for w in caught] == [__file__]
    expected = _net()
    x = torch.randn(2, 4)
    model = _net()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with pytest.warns(UserWarning, match=message):
        model = load_checkpoint_and_dispatch(model, tmp_path, device_map={"": "cpu"})
    assert torch.equal(model(x), expected(x))


def test_a_tensor_in_no_shard_is_named_and_reported_missing(tmp_path: Path) -> None:
    index = _shards(tmp_path, TRUE_MAP)
    state = _net().state_dict()
    save_file({"0.weight": state["0.weight"], "0.bias": state["0.bias"]}, tmp_path / "a.safetensors")  # 2.bias lost
    with pytest.warns(UserWarning, match=r"'2\.bias' \(indexed in 'a\.safetensors', in no shard\)"):
        infos = read_tensor_infos(resolve_checkpoint_files(index))
    assert "2.bias" not in infos


def test_a_tensor_in_both_shards_the_indexed_one_among_them_still_loads(tmp_path: Path) -> None:
    import warnings

    index = _shards(tmp_path, TRUE_MAP)
    state = _net().state_dict()
    save_file({"2.weight": state["2.weight"], "2.bias": state["2.bias"]}, tmp_path / "b.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        infos = read_tensor_infos(resolve_checkpoint_files(index))
    assert infos["2.bias"].file.name == "a.safetensors" and infos["2.weight"].file.name == "b.safetensors"
