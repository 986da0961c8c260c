"""load_converted_checkpoint: checkpoint keys renamed and tensors built from several keys, on a plain module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import init_empty_weights
from bigmodel.loading.conversion import KeyConversion, TensorRecipe
from bigmodel.loading.loader import load_converted_checkpoint


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 3, bias=False)
        self.fused = nn.Parameter(torch.zeros(2, 3, 4))  # two experts, stacked


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    stored = {
        "out.weight": torch.randn(3, 4, generator=generator),  # the model calls it head.weight
        "experts.0.w": torch.randn(3, 4, generator=generator),
        "experts.1.w": torch.randn(3, 4, generator=generator),
    }
    folder.mkdir()
    save_file(stored, str(folder / "model.safetensors"))
    return stored


def _stack(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"fused": torch.stack(list(tensors))}


CONVERSION = KeyConversion({"out.weight": "head.weight"}, [TensorRecipe(("experts.0.w", "experts.1.w"), _stack)])


@pytest.mark.parametrize("device", ["cpu", "disk"])
def test_renamed_and_built_tensors_land_in_the_model(device: str, tmp_path: Path) -> None:
    stored = _checkpoint(tmp_path / "ckpt")
    with init_empty_weights():
        model = Experts()
    offload = tmp_path / "off"
    load_converted_checkpoint(
        model, tmp_path / "ckpt", CONVERSION, device_map={"": device}, offload_folder=offload, strict=True
    )
    if device == "cpu":
        assert torch.equal(model.head.weight, stored["out.weight"])
        assert torch.equal(model.fused, torch.stack([stored["experts.0.w"], stored["experts.1.w"]]))
        return
    index = json.loads((offload / "index.json").read_text())
    assert index["head.weight"]["weight_name"] == "out.weight"  # renamed: still read in place
    assert index["fused"] == {"dtype": "float32", "shape": [2, 3, 4]}  # built: written once
    assert sorted(p.name for p in offload.iterdir()) == ["fused.dat", "index.json"]


def test_a_recipe_that_does_not_fit_the_shapes_fails_before_loading(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ckpt")
    with init_empty_weights():
        model = Experts()
    concatenate = TensorRecipe(("experts.0.w", "experts.1.w"), lambda ts: {"fused": torch.cat(list(ts), dim=1)})
    bad = KeyConversion({"out.weight": "head.weight"}, [concatenate])
    with pytest.raises(ValueError, match=r"Shape mismatch.*'fused': checkpoint \[3, 8\] vs model \[2, 3, 4\]"):
        load_converted_checkpoint(model, tmp_path / "ckpt", bad, device_map={"": "cpu"})
    broken = KeyConversion({}, [TensorRecipe(("experts.0.w", "experts.1.w"), lambda ts: {"fused": ts[0] @ ts[1]})])
    with pytest.raises(ValueError, match=r"Cannot convert the checkpoint tensors experts\.0\.w, experts\.1\.w"):
        load_converted_checkpoint(model, tmp_path / "ckpt", broken, device_map={"": "cpu"})
    assert model.head.weight.is_meta and model.fused.is_meta  # nothing was loaded


def test_two_keys_for_one_name_load_the_first_in_checkpoint_order_unless_ignored(tmp_path: Path) -> None:
    stored = _checkpoint(tmp_path / "ckpt")  # header order: experts.0.w, experts.1.w, out.weight
    renames = {"out.weight": "weight", "experts.0.w": "weight", "experts.1.w": "unused"}
    for ignored, expected in ((frozenset(), "experts.0.w"), (frozenset({"experts.0.w"}), "out.weight")):
        with init_empty_weights():
            model = nn.Linear(4, 3, bias=False)
        load_converted_checkpoint(model, tmp_path / "ckpt", KeyConversion(renames, (), ignored), device_map={"": "cpu"})
        assert torch.equal(model.weight, stored[expected])
