"""A device-map key that names nothing in the model gets a ``UserWarning`` naming the key.

The incumbent's ``check_device_map`` warns "The following device_map keys do not match any
submodules in the model: [...]"; code filters that warning by its text, so the text is the
same.  Keys naming a parameter or buffer are valid bigmodel keys (a map may place single
tensors) and are not warned about.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    check_device_map,
    dispatch_model,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)

MESSAGE = "The following device_map keys do not match any submodules in the model"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


GOOD = {"layers.0": "cpu", "layers.1": "cpu", "head": "cpu"}


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"layers.7": "cpu"}, "'layers.7'"), ({"decoder": "disk", "layers.1.nope": "cpu"}, "'decoder', 'layers.1.nope'")],
)
def test_check_device_map_warns_naming_each_unknown_key(extra, named):
    with pytest.warns(UserWarning, match=MESSAGE) as caught:
        check_device_map(Net(), {**GOOD, **extra})
    texts = [(str(w.message), w.filename) for w in caught if MESSAGE in str(w.message)]
    assert texts == [(f"{MESSAGE}: [{named}]", __file__)]


@pytest.mark.parametrize(
    "device_map",
    [GOOD, {"": "cpu"}, {"layers": "cpu", "head.weight": "cpu", "head.bias": "cpu"}, {"layers.0.weight": "cpu", "": "cpu"}],
)
def test_keys_naming_modules_or_tensors_are_not_warned_about(device_map):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_device_map(Net(), device_map)


def test_dispatch_model_warns_and_still_runs():
    model = Net()
    x = torch.ones(1, 4)
    expected = model(x)
    with pytest.warns(UserWarning, match=rf"{MESSAGE}: \['layers\.9'\]") as caught:
        dispatched = dispatch_model(model, {**GOOD, "layers.9": "cpu"})
    assert torch.equal(dispatched(x), expected)
    assert [w.filename for w in caught if MESSAGE in str(w.message)] == [__file__]  # the user's line, not bigmodel's


def test_load_checkpoint_and_dispatch_warns(tmp_path):
    torch.manual_seed(0)
    source = Net()
    save_file(source.state_dict(), tmp_path / "model.safetensors")
    with init_empty_weights():
        model = Net()
    with pytest.warns(UserWarning, match=rf"{MESSAGE}: \['lm_head'\]") as caught:
        model = load_checkpoint_and_dispatch(model, str(tmp_path), device_map={**GOOD, "lm_head": "cpu"})
    assert {w.filename for w in caught if MESSAGE in str(w.message)} == {__file__}
    assert torch.equal(model.head.weight, source.head.weight)


def test_an_uncovered_tensor_is_still_an_error_naming_it():
    with pytest.raises(ValueError, match=r"does not cover 2 parameters/buffers of Net: head\.weight, head\.bias"):
        check_device_map(Net(), {"layers": "cpu"})
