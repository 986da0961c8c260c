"""Arguments of the wrong type fail with a TypeError naming the argument, what was given and what is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import bigmodel
from bigmodel import dispatch_model, infer_auto_device_map, init_empty_weights, load_checkpoint_and_dispatch


def _saved(tmp_path: Path) -> Path:
    save_file({k: v.contiguous() for k, v in nn.Linear(4, 3).state_dict().items()}, tmp_path / "model.safetensors")
    return tmp_path


def _empty() -> nn.Module:
    with init_empty_weights():
        return nn.Linear(4, 3)


def test_a_list_device_map_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"device_map=\['cpu'\] \(a list\).*dict.*'auto'"):
        load_checkpoint_and_dispatch(_empty(), _saved(tmp_path), device_map=["cpu"])
    with pytest.raises(TypeError, match=r"device_map=\['cpu'\] \(a list\)"):
        dispatch_model(nn.Linear(4, 3), device_map=["cpu"])


def test_a_list_max_memory_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"max_memory=\['1GB'\] \(a list\).*dict.*\{'cpu': '1GB'\}"):
        load_checkpoint_and_dispatch(_empty(), _saved(tmp_path), device_map="auto", max_memory=["1GB"])
    with pytest.raises(TypeError, match=r"max_memory=\['1GB'\]"):
        infer_auto_device_map(nn.Linear(4, 3), max_memory=["1GB"])


def test_offload_state_dict_with_a_non_tensor_names_the_key_and_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "off"
    with pytest.raises(TypeError, match=r"state_dict\['a'\] is a int, not a torch.Tensor"):
        bigmodel.offload_state_dict(folder, {"w": torch.ones(2), "a": 5})
    assert not (folder / "index.json").exists()
    assert list(folder.glob("*.dat")) == [] if folder.exists() else True
