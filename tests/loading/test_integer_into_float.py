"""An integer or bool checkpoint tensor is never cast into a floating parameter silently."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import load_checkpoint_in_model


def _checkpoint(tmp_path: Path, weight: torch.Tensor) -> Path:
    torch.manual_seed(0)
    sd = {k: v.contiguous() for k, v in nn.Linear(4, 8).state_dict().items()}
    save_file({**sd, "weight": weight}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_an_integer_checkpoint_value_for_a_float_parameter_is_an_error(tmp_path: Path, dtype) -> None:
    model = nn.Linear(4, 8)
    before = model.weight.detach().clone()
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(TypeError, match=rf"'weight'.*checkpoint dtype {name}.*parameter dtype float32"):
        load_checkpoint_in_model(model, _checkpoint(tmp_path, torch.ones(8, 4, dtype=dtype)))
    assert torch.equal(model.weight, before)


def test_a_float_value_of_another_dtype_is_still_cast(tmp_path: Path) -> None:
    model = nn.Linear(4, 8)
    load_checkpoint_in_model(model, _checkpoint(tmp_path, torch.full((8, 4), 0.5, dtype=torch.float16)))
    assert model.weight.dtype == torch.float32 and torch.equal(model.weight, torch.full((8, 4), 0.5))


def test_an_integer_buffer_takes_an_integer_value(tmp_path: Path) -> None:
    model = nn.Module()
    model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
    save_file({"steps": torch.tensor([1, 2, 3], dtype=torch.int32)}, tmp_path / "model.safetensors")
    load_checkpoint_in_model(model, tmp_path)
    assert model.steps.tolist() == [1, 2, 3]
