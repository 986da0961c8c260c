"""``strict=True`` mismatches raise what code written for accelerate catches.

accelerate 1.15 loads a checkpoint without a device map through torch's ``load_state_dict``, whose
mismatch error is a ``RuntimeError`` ("Error(s) in loading state_dict ... Unexpected key(s)"); code
catches it as such.  bigmodel's mismatch error is a ``ValueError`` naming the keys; it is a
``RuntimeError`` as well, so both ``except`` clauses work, with or without a device map.
"""

from __future__ import annotations

import accelerate
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import load_checkpoint_in_model


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


@pytest.fixture
def extra_key_checkpoint(tmp_path):
    state = dict(_two_linears().state_dict())
    state["2.weight"] = torch.ones(2)
    path = tmp_path / "extra.safetensors"
    save_file(state, path)
    return path


def test_the_incumbent_raises_runtime_error_for_an_unexpected_key(extra_key_checkpoint):
    with pytest.raises(RuntimeError, match="2.weight"):
        accelerate.load_checkpoint_in_model(_two_linears(), str(extra_key_checkpoint), strict=True)


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}, {"0": "cpu", "1": "disk"}])
@pytest.mark.parametrize("caught", [RuntimeError, ValueError])
def test_an_unexpected_key_with_strict_is_caught_as_runtime_or_value_error(extra_key_checkpoint, tmp_path, device_map, caught):
    model = _two_linears()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(caught, match=r"unexpected keys \(1\): 2\.weight"):
        load_checkpoint_in_model(model, extra_key_checkpoint, device_map=device_map, strict=True, offload_folder=tmp_path / "off")
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())  # nothing loaded


@pytest.fixture
def missing_key_checkpoint(tmp_path):
    state = dict(_two_linears().state_dict())
    del state["1.bias"]
    path = tmp_path / "missing.safetensors"
    save_file(state, path)
    return path


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}])
def test_the_incumbent_loads_a_checkpoint_missing_a_key_with_strict(missing_key_checkpoint, device_map):
    # accelerate 1.15 checks only unexpected keys (huggingface/accelerate PR #2641 added `strict` to
    # load_checkpoint_and_dispatch): without a map it loads through torch's set_model_state_dict, which
    # does not raise for it; with a map the key is never looked for.  The model keeps its own value.
    model = _two_linears()
    accelerate.load_checkpoint_in_model(model, str(missing_key_checkpoint), device_map=device_map, strict=True)
    assert torch.equal(model[1].bias, _two_linears()[1].bias)


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}])
def test_a_missing_key_with_strict_is_refused_naming_it(missing_key_checkpoint, device_map):
    with pytest.raises(ValueError, match=r"missing keys \(1\): 1\.bias"):
        load_checkpoint_in_model(_two_linears(), missing_key_checkpoint, device_map=device_map, strict=True)
