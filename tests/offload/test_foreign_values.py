"""An offload folder (or weights map) holding a tensor of another shape than the model's is refused, naming it.

Before the fix the offload hook used the value as it found it: a bias of shape ``[1]`` in place of
a ``[2]`` one broadcast, and the forward returned wrong outputs without an error.  The index can say
the right shape while the file it points into holds another (an in-place safetensors entry), and an
``offload_index`` or a ``weights_map`` given by the caller is not checked against the folder at
all.  accelerate 1.15 raises ``ValueError`` ("Trying to set a tensor of shape ...") in each case.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    OffloadedWeightsLoader,
    attach_align_device_hook,
    dispatch_model,
    init_empty_weights,
)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _folder_pointing_into(tmp_path: Path, state: dict[str, torch.Tensor]) -> tuple[Path, dict]:
    """An offload folder whose index gives the model's shapes, pointing into a file that holds ``state``."""
    save_file(state, tmp_path / "other.safetensors")
    shapes = {name: list(t.shape) for name, t in _net().state_dict().items()}
    index = {
        name: {"safetensors_file": str(tmp_path / "other.safetensors"), "weight_name": name, "dtype": "float32",
               "shape": shape}
        for name, shape in shapes.items()
    }  # fmt: skip
    folder = tmp_path / "offload"
    folder.mkdir()
    (folder / "index.json").write_text(json.dumps(index))
    return folder, index


MESSAGE = r"Offloaded tensor '1\.bias' has shape \[1\] in its weights map .* but \[2\] in the model.*offload this model"


@pytest.fixture
def foreign(tmp_path: Path) -> tuple[Path, dict]:
    return _folder_pointing_into(tmp_path, {**_net().state_dict(), "1.bias": torch.tensor([5.0])})


@pytest.mark.parametrize("how", ["offload_dir", "offload_index"])
def test_dispatch_from_a_folder_whose_file_holds_another_shape_is_refused(foreign, how: str) -> None:
    folder, index = foreign
    with init_empty_weights():
        model = _net()
    dispatch_model(model, device_map={"": "disk"}, offload_dir=folder,
                   offload_index=index if how == "offload_index" else None)  # fmt: skip
    with pytest.raises(ValueError, match=MESSAGE):  # before the fix: wrong outputs, no error
        model(torch.ones(1, 4))
    assert model[1].bias.device.type == "meta"  # the failed forward left nothing loaded


def test_a_weights_map_of_another_shape_given_to_the_hook_is_refused(foreign) -> None:
    folder, _ = foreign
    with init_empty_weights():
        model = _net()
    attach_align_device_hook(model, execution_device="cpu", offload=True, weights_map=OffloadedWeightsLoader(
        save_folder=folder))  # fmt: skip
    with pytest.raises(ValueError, match=MESSAGE):
        model(torch.ones(1, 4))


def test_the_same_folder_with_the_right_shapes_still_runs(tmp_path: Path) -> None:
    expected = _net()(torch.ones(1, 4))
    folder, _ = _folder_pointing_into(tmp_path, _net().state_dict())
    with init_empty_weights():
        model = _net()
    dispatch_model(model, device_map={"": "disk"}, offload_dir=folder)
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 4)), expected)
