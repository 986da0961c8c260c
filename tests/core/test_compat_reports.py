"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both.

Each test names the observable behaviour of accelerate it pins (checked by running the snippet
against accelerate 1.15.0); none reads accelerate's code.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bigmodel import init_empty_weights, init_on_device
from bigmodel.utils import set_module_tensor_to_device


class _Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.register_buffer("mask", torch.zeros(3, dtype=torch.bool))
        self.register_buffer("position_ids", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))


@pytest.mark.parametrize(
    ("name", "value", "expected_dtype", "expected"),
    [
        # a float16 checkpoint value for a bool causal mask stays a bool mask
        ("mask", torch.tensor([1.0, 0.0, 1.0], dtype=torch.float16), torch.bool, [True, False, True]),
        # int32 position ids saved by another framework, int64 in the model
        ("position_ids", torch.tensor([0, 1, 2], dtype=torch.int32), torch.int64, [0, 1, 2]),
        # integer values for a float parameter become float (and it keeps requires_grad)
        ("weight", torch.tensor([1, 2, 3], dtype=torch.int8), torch.float32, [1.0, 2.0, 3.0]),
    ],
)
def test_value_without_dtype_takes_the_model_tensors_dtype(name, value, expected_dtype, expected):
    # accelerate 1.15 (and torch's load_state_dict) copy the value into the model tensor's dtype
    model = _Holder()
    set_module_tensor_to_device(model, name, "cpu", value=value)
    tensor = getattr(model, name)
    assert tensor.dtype == expected_dtype
    assert tensor.tolist() == expected
    if name == "weight":
        assert isinstance(tensor, nn.Parameter) and tensor.requires_grad


def test_float_scalar_for_num_batches_tracked_stays_long():
    model = _Holder()
    set_module_tensor_to_device(model, "num_batches_tracked", "cpu", value=torch.tensor(7.0))
    assert model.num_batches_tracked.dtype == torch.long and model.num_batches_tracked.item() == 7


def test_explicit_dtype_still_leaves_integer_values_alone():
    # with dtype=, accelerate casts floating values only: an integer value keeps its dtype
    model = _Holder()
    set_module_tensor_to_device(model, "position_ids", "cpu", value=torch.arange(3, dtype=torch.int32), dtype=torch.float16)
    assert model.position_ids.dtype == torch.int32
    set_module_tensor_to_device(model, "weight", "cpu", value=torch.ones(3, dtype=torch.float64), dtype=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16
