"""load_checkpoint_and_dispatch refuses a checkpoint that leaves tensors on meta, before dispatching,
and leaves the offload folder as it found it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model


def _make() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _empty() -> nn.Sequential:
    with init_empty_weights():
        return _make()


@pytest.fixture
def lacking_bias(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in _make().state_dict().items() if k != "2.bias"}
    save_file(sd, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("kwargs", [{"device_map": {"": "cpu"}}, {"device_map": "auto", "max_memory": {"cpu": 100}}])
def test_a_missing_key_is_one_clear_error_and_the_folder_is_removed(lacking_bias, tmp_path, kwargs) -> None:
    folder = tmp_path / "F"
    with pytest.raises(ValueError, match=r"still on the meta device.*did not provide them: 2\.bias\. Fix the checkpoint"):
        load_checkpoint_and_dispatch(_empty(), lacking_bias, offload_folder=folder, **kwargs)
    assert not folder.exists()


def test_what_the_folder_held_before_is_kept(lacking_bias, tmp_path) -> None:
    folder = tmp_path / "F"
    folder.mkdir()
    (folder / "index.json").write_text(json.dumps({"old": {"dtype": "float32", "shape": [2]}}))
    torch.ones(2).numpy().tofile(folder / "old.dat")
    with pytest.raises(ValueError, match=r"2\.bias"):
        load_checkpoint_and_dispatch(_empty(), lacking_bias, device_map={"0": "cpu", "1": "cpu", "2": "disk"},
                                     offload_folder=folder)  # fmt: skip
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "old.dat"]
    assert json.loads((folder / "index.json").read_text()) == {"old": {"dtype": "float32", "shape": [2]}}


def test_load_checkpoint_in_model_stays_lenient(lacking_bias, caplog) -> None:
    model = _empty()
    with caplog.at_level(logging.WARNING):
        load_checkpoint_in_model(model, lacking_bias)
    assert "missing keys (1): 2.bias" in caplog.text
    assert model[2].bias.device.type == "meta" and model[2].weight.device.type == "cpu"
    with pytest.raises(ValueError, match=r"missing keys \(1\): 2\.bias"):
        load_checkpoint_in_model(_empty(), lacking_bias, strict=True)


def test_without_a_device_map_the_model_comes_back_as_loaded(lacking_bias, caplog) -> None:
    """No dispatch, no check (the incumbent returns the loaded model): the missing key is logged."""
    with caplog.at_level(logging.WARNING):
        model = load_checkpoint_and_dispatch(_empty(), lacking_bias)
    assert "missing keys (1): 2.bias" in caplog.text
    assert model[2].bias.device.type == "meta" and model[0].weight.device.type == "cpu"


def test_a_stale_entry_in_the_offload_folder_does_not_fill_a_missing_key(lacking_bias, tmp_path) -> None:
    """The folder held another model's offload of ``2.bias`` (same shape): the checkpoint lacking it
    must not be dispatched with that value, and the folder keeps what it held."""
    folder = tmp_path / "F"
    stale = {k: torch.full_like(v, 7.0) for k, v in _make().state_dict().items()}
    other = tmp_path / "other"
    other.mkdir()
    save_file(stale, other / "model.safetensors")
    device_map = {"0": "cpu", "1": "cpu", "2": "disk"}
    load_checkpoint_and_dispatch(_empty(), other, device_map=device_map, offload_folder=folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    with pytest.raises(ValueError, match=r"still on the meta device.*did not provide them: 2\.bias\. Fix"):
        load_checkpoint_and_dispatch(_empty(), lacking_bias, device_map=device_map, offload_folder=folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_a_disk_tensor_an_earlier_load_of_the_same_model_filled_counts_as_filled(lacking_bias, tmp_path) -> None:
    """A checkpoint in two parts: the first load puts ``2.bias`` on disk, the second (lacking it) dispatches."""
    torch.manual_seed(0)
    full = _make()
    bias_only = tmp_path / "bias"
    bias_only.mkdir()
    save_file({"2.bias": full[2].bias.detach().contiguous()}, bias_only / "model.safetensors")
    folder, device_map = tmp_path / "F", {"0": "cpu", "1": "cpu", "2": "disk"}
    model = _empty()
    load_checkpoint_in_model(model, bias_only, device_map=device_map, offload_folder=folder)
    model = load_checkpoint_and_dispatch(model, lacking_bias, device_map=device_map, offload_folder=folder)
    x = torch.randn(2, 4)
    assert torch.equal(model(x), full(x))
