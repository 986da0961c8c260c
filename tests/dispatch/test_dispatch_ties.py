"""One rule for tied parameters whose modules are mapped to different devices, in dispatch_model and
load_checkpoint_and_dispatch alike: each member keeps a value on its own device (the group is not
tied while dispatched) and a warning names the group and the devices; a group on one device is tied.

Two accelerators are simulated on the CPU with ``"cpu"`` and ``"meta"`` as the two devices: with
the group re-tied onto one of them (what dispatch_model did, and accelerate's does), the member
mapped to the other device holds a value on the wrong device; on two GPUs its forward then fails
with a device mismatch.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    remove_hook_from_submodules,
)


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.mid(self.emb(ids)))


IDS = torch.tensor([[1, 2, 3]])
SPLIT = {"emb": "cpu", "mid": "cpu", "head": "meta"}
TOGETHER = {"emb": "cpu", "mid": "meta", "head": "cpu"}


def _dispatched(entry: str, device_map: dict, tmp_path) -> TiedLM:
    torch.manual_seed(0)
    model = TiedLM().eval()
    if entry == "dispatch_model":
        return dispatch_model(model, device_map, main_device="cpu")
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # saved once, as tied checkpoints are
    save_file(state, str(tmp_path / "model.safetensors"))
    with init_empty_weights():
        empty = TiedLM().eval()
    return load_checkpoint_and_dispatch(empty, str(tmp_path), device_map=device_map)


@pytest.mark.parametrize("entry", ["dispatch_model", "load_checkpoint_and_dispatch"])
def test_a_tied_group_split_across_devices_is_untied_with_a_warning(entry, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        model = _dispatched(entry, SPLIT, tmp_path)
    assert model.head.weight is not model.emb.weight
    assert model.head.weight.device.type == "meta"  # each member on the device its module runs on
    assert model.emb.weight.device.type == "cpu"
    warning = [r.getMessage() for r in caplog.records if "tied" in r.getMessage()]
    assert len(warning) == 1
    assert "['emb.weight', 'head.weight']" in warning[0] and "['cpu', 'meta']" in warning[0]
    assert "no longer tied" in warning[0]
    with torch.no_grad():
        assert model(IDS).device.type == "meta"  # runs: the head's weight and input are on the head's device


@pytest.mark.parametrize("entry", ["dispatch_model", "load_checkpoint_and_dispatch"])
def test_a_tied_group_on_one_device_stays_tied(entry, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        model = _dispatched(entry, TOGETHER, tmp_path)
    assert model.head.weight is model.emb.weight and model.emb.weight.device.type == "cpu"
    assert not [r for r in caplog.records if "tied" in r.getMessage()]


def test_dispatch_model_reties_a_split_group_when_its_hooks_are_removed(tmp_path):
    model = _dispatched("dispatch_model", SPLIT, tmp_path)
    remove_hook_from_submodules(model)
    assert model.head.weight is model.emb.weight  # the model as it was before dispatch
