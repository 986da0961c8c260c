"""Non-persistent buffers left on ``meta`` by ``init_empty_weights(include_buffers=True)`` are named, with the fix.

No checkpoint holds a non-persistent buffer (a rotary embedding's ``inv_freq``), so after a load of a
model built with ``include_buffers=True`` it has no value.  Before, the load was silent and the first
forward failed with torch's "Tensor on device meta is not on the expected device cpu!", or a dispatch
with a disk part raised "inv_freq is on the meta device and has no data; pass `value=`": neither names
the module (``rot.inv_freq``) nor the fix.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import dispatch_model, init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model

FIX = r"never saved in a checkpoint.*init_empty_weights\(\) without include_buffers=True"


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.inv_freq


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.rot = Rotary()
        self.out = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rot(self.lin(x)))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    save_file(Net().state_dict(), tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def _empty(include_buffers: bool = True) -> Net:
    with init_empty_weights(include_buffers=include_buffers):
        return Net()


MAPS = [{"": "cpu"}, {"lin": "cpu", "rot": "cpu", "out": "disk"}, {"lin": "cpu", "out": "disk"}, "auto"]


@pytest.mark.parametrize("device_map", MAPS)
def test_load_checkpoint_and_dispatch_names_the_buffer_and_the_fix(checkpoint, tmp_path, device_map):
    offload = tmp_path / "offload"
    named = r"non-persistent buffer\(s\) of Net are on the meta device.*rot\.inv_freq\. "
    with pytest.raises(ValueError, match=named + ".*" + FIX):
        load_checkpoint_and_dispatch(_empty(), checkpoint, device_map=device_map, max_memory={"cpu": 100},
                                     offload_folder=offload)  # fmt: skip
    assert not offload.exists() or not any(offload.iterdir())  # nothing left in the folder


def test_load_checkpoint_in_model_warns_naming_the_buffer(checkpoint, caplog):
    model = _empty()
    with caplog.at_level(logging.WARNING):
        load_checkpoint_in_model(model, checkpoint)
    assert "1 non-persistent buffer(s) stay on the meta device: rot.inv_freq" in caplog.text
    assert "without include_buffers=True" in caplog.text


@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"lin": "cpu", "rot": "cpu", "out": "disk"}])
def test_dispatch_model_names_the_buffer_before_hooking(checkpoint, tmp_path, device_map):
    model = _empty()
    load_checkpoint_in_model(model, checkpoint)
    with pytest.raises(NotImplementedError, match=rf"rot\.inv_freq\. .*{FIX}"):
        dispatch_model(model, device_map, offload_dir=tmp_path / "offload")
    assert not hasattr(model.out, "_hf_hook")


def test_the_fix_the_message_gives_works(checkpoint, tmp_path):
    model = load_checkpoint_and_dispatch(_empty(include_buffers=False), checkpoint,
                                         device_map={"lin": "cpu", "rot": "cpu", "out": "disk"},
                                         offload_folder=tmp_path / "offload")  # fmt: skip
    torch.manual_seed(0)
    reference = Net()
    x = torch.randn(2, 4)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


@pytest.mark.parametrize("meta", ["meta", torch.device("meta")])
def test_a_module_mapped_to_meta_is_left_on_meta_however_meta_is_spelled(checkpoint, meta):
    model = load_checkpoint_and_dispatch(_empty(), checkpoint, device_map={"lin": "cpu", "rot": meta, "out": meta})
    assert model.out.weight.device.type == "meta" and model.lin.weight.device.type == "cpu"
