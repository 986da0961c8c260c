"""Device maps with overlapping keys: each tensor goes to the device of its longest matching key,
on the load path as in ``dispatch_model`` (accelerate's behaviour)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import dispatch_model, get_state_dict_offloaded_model, init_empty_weights, load_checkpoint_and_dispatch
from bigmodel.planning.disjoint import disjoint_device_map, module_blocks


def _make() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    ref = _make()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, tmp_path / "model.safetensors")
    return ref, tmp_path


@pytest.mark.parametrize(
    ("device_map", "on_disk", "held"),
    [
        ({"": "disk", "0": "cpu"}, {"2.weight", "2.bias"}, {"0.weight", "0.bias"}),
        ({"": "cpu", "0": "disk"}, {"0.weight", "0.bias"}, {"2.weight", "2.bias"}),
        # 0.bias stays in RAM, read by the hook of the offloaded module 0 (whose weight is on disk)
        ({"0": "cpu", "0.weight": "disk", "2": "cpu"}, {"0.weight"}, {"2.weight", "2.bias"}),
    ],
)
def test_load_and_dispatch_follows_the_longest_matching_key(saved, tmp_path: Path, device_map, on_disk, held) -> None:
    ref, folder = saved
    with init_empty_weights():
        model = _make()
    offload = tmp_path / "off"
    model = load_checkpoint_and_dispatch(model, folder, device_map=device_map, offload_folder=offload)
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    assert set(json.loads((offload / "index.json").read_text())) == on_disk
    assert {p.name for p in offload.glob("*.dat")} <= {f"{n}.dat" for n in on_disk}
    in_ram = {name for name, t in model.state_dict(keep_vars=True).items() if t.device.type == "cpu"}
    assert in_ram == held
    values = get_state_dict_offloaded_model(model)
    assert all(torch.equal(values[k], v) for k, v in ref.state_dict().items())
    assert model.hf_device_map == device_map


def test_disjoint_device_map_splits_the_keys_holding_other_keys() -> None:
    model = _make()
    assert disjoint_device_map(model, {"": "disk", "0": "cpu"}) == {"0": "cpu", "1": "disk", "2": "disk"}
    assert disjoint_device_map(model, {"0": "cpu", "0.weight": "disk", "2": "cpu"}) == {
        "0.weight": "disk", "0.bias": "cpu", "2": "cpu",
    }  # fmt: skip
    assert disjoint_device_map(model, {"0": "cpu", "2": "disk"}) == {"0": "cpu", "2": "disk"}


def test_module_blocks_offload_a_module_with_one_tensor_on_disk() -> None:
    blocks, served = module_blocks(_make(), {"0.weight": "disk", "0.bias": "cpu", "2": "cpu"}, ("disk",))
    assert blocks == {"0": "disk", "2": "cpu"}
    assert served == ["0.bias"]


def test_dispatch_model_of_a_loaded_model_follows_the_longest_matching_key(saved, tmp_path: Path) -> None:
    ref, _ = saved
    model = _make()
    model.load_state_dict(ref.state_dict())
    model = dispatch_model(model, {"": "disk", "0": "cpu"}, offload_dir=tmp_path / "off")
    x = torch.randn(2, 4)
    assert torch.equal(model(x), ref(x))
    assert set(json.loads((tmp_path / "off" / "index.json").read_text())) == {"2.weight", "2.bias"}
    assert model[0].weight.device.type == "cpu" and model[2].weight.device.type == "meta"
