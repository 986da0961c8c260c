"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import load_checkpoint_and_dispatch
from bigmodel.utils import load_checkpoint_in_model


@pytest.mark.parametrize("load", [load_checkpoint_in_model, load_checkpoint_and_dispatch])
def test_a_missing_checkpoint_path_is_a_value_error_as_with_accelerate(tmp_path, load):
    # accelerate 1.15 raises ValueError for a path that is neither a file nor a folder; code
    # written for it catches ValueError (a fallback to another path, a friendly message).
    missing = tmp_path / "not-downloaded"
    with pytest.raises(ValueError, match=r"not-downloaded' does not exist; "):
        load(nn.Linear(2, 2), missing, device_map={"": "cpu"})
    with pytest.raises(FileNotFoundError):  # what bigmodel raised before: still caught the same way
        load(nn.Linear(2, 2), str(missing))


def _linear_state(value: float) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((2, 2), value), "bias": torch.full((2,), value)}


def test_a_folder_with_safetensors_and_pytorch_model_bin_says_which_one_it_loads(tmp_path, caplog):
    # accelerate 1.15 loads pytorch_model.bin from this folder; bigmodel loads model.safetensors (no
    # pickle, read lazily) and, since the two may differ (a stale copy), says so once per folder.
    save_file(_linear_state(1.0), tmp_path / "model.safetensors")
    torch.save(_linear_state(2.0), tmp_path / "pytorch_model.bin")
    with caplog.at_level("WARNING", logger="bigmodel.checkpoints.resolve"):
        layer = nn.Linear(2, 2)
        load_checkpoint_in_model(layer, tmp_path)
        load_checkpoint_in_model(nn.Linear(2, 2), tmp_path)  # the same folder again: no second warning
    assert layer.weight.unique().tolist() == [1.0]
    expected = (
        f"Checkpoint folder {str(tmp_path)!r} holds both model.safetensors and pytorch_model.bin; loading "
        "model.safetensors (safetensors: read lazily, no pickle). accelerate 1.15 loads pytorch_model.bin from "
        "such a folder; pass that file's path to load it instead."
    )
    assert [r.getMessage() for r in caplog.records] == [expected]
    load_checkpoint_in_model(layer, tmp_path / "pytorch_model.bin")
    assert layer.weight.unique().tolist() == [2.0]


def test_a_sharded_safetensors_folder_alone_loads_without_a_warning(tmp_path, caplog):
    save_file({"weight": torch.ones(2, 2)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"bias": torch.ones(2)}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"weight": "model-00001-of-00002.safetensors", "bias": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with caplog.at_level("WARNING", logger="bigmodel.checkpoints.resolve"):
        load_checkpoint_in_model(nn.Linear(2, 2), tmp_path)
    assert caplog.records == []
