import pytest
import torch
from torch import nn

from bigmodel import (
    check_tied_parameters_on_same_device,
    find_tied_parameters,
    get_module_size_with_ties,
    get_non_persistent_buffers,
    init_empty_weights,
    named_module_tensors,
    retie_parameters,
    set_module_tensor_to_device,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def test_named_module_tensors():
    block = Block()
    assert [n for n, _ in named_module_tensors(block)] == ["scale", "cache"]
    assert [n for n, _ in named_module_tensors(block, recurse=True)] == [
        "linear.weight",
        "linear.bias",
        "scale",
        "cache",
    ]
    names = [n for n, _ in named_module_tensors(block, recurse=True, remove_non_persistent=True)]
    assert names == ["linear.weight", "linear.bias", "scale"]
    assert [n for n, _ in named_module_tensors(block, include_buffers=False, recurse=True)] == [
        "linear.weight",
        "linear.bias",
    ]


def test_get_non_persistent_buffers():
    model = nn.Sequential(Block(), Block())
    assert get_non_persistent_buffers(model[0]) == {"cache"}
    assert get_non_persistent_buffers(model, recurse=True) == {"cache"}  # bare names, as accelerate returns
    assert get_non_persistent_buffers(model, recurse=True, fqns=True) == {"0.cache", "1.cache"}
    assert get_non_persistent_buffers(model) == set()
    assert get_non_persistent_buffers(model, fqns=True) == set()  # fqns only matters with recurse
    returned = get_non_persistent_buffers(model[0], recurse=True)
    returned.add("other")
    assert model[0]._non_persistent_buffers_set == {"cache"}  # a new set: the module's is never changed


def test_offload_buffers_keeps_nested_non_persistent_buffers_off_the_weights_map():
    from bigmodel import AlignDevicesHook, add_hook_to_module

    model = nn.Sequential(Block(), Block())
    add_hook_to_module(model, AlignDevicesHook("cpu", offload=True, offload_buffers=True, place_submodules=True))
    assert sorted(model._hf_hook.weights_map) == [
        "0.linear.bias", "0.linear.weight", "0.scale", "1.linear.bias", "1.linear.weight", "1.scale",
    ]  # fmt: skip
    assert not model[0].cache.is_meta and model[0].scale.is_meta  # non-persistent: stays on the device


def test_set_module_tensor_from_meta_with_value_and_casts():
    with init_empty_weights():
        model = nn.Sequential(Block())
    value = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    set_module_tensor_to_device(model, "0.linear.weight", "cpu", value=value)
    weight = model[0].linear.weight
    assert isinstance(weight, nn.Parameter) and weight.dtype == torch.float32
    assert torch.equal(weight, value.float())
    set_module_tensor_to_device(model, "0.linear.bias", "cpu", value=torch.ones(4), dtype=torch.bfloat16)
    assert model[0].linear.bias.dtype == torch.bfloat16


def test_set_module_tensor_integer_value_keeps_dtype():
    model = nn.Module()
    model.register_buffer("ids", torch.zeros(3, dtype=torch.int64))
    set_module_tensor_to_device(model, "ids", "cpu", value=torch.tensor([1, 2, 3], dtype=torch.int32), dtype=torch.float16)
    assert model.ids.dtype == torch.int32
    assert model.ids.tolist() == [1, 2, 3]


def test_set_module_tensor_in_place_no_copy_for_same_dtype():
    with init_empty_weights():
        layer = nn.Linear(4, 4)
    value = torch.randn(4, 4)
    set_module_tensor_to_device(layer, "weight", "cpu", value=value)
    assert layer.weight.data_ptr() == value.data_ptr()


def test_set_module_tensor_errors():
    with init_empty_weights():
        model = nn.Sequential(Block())
    with pytest.raises(ValueError, match=r"0\.linear\.weight.*\(3, 3\).*\(4, 4\)"):
        set_module_tensor_to_device(model, "0.linear.weight", "cpu", value=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=r"0\.linear\.weight is on the meta device.*value="):
        set_module_tensor_to_device(model, "0.linear.weight", "cpu")
    with pytest.raises(AttributeError, match="no parameter or buffer named 'nope'"):
        set_module_tensor_to_device(model, "0.linear.nope", "cpu", value=torch.zeros(1))
    with pytest.raises(AttributeError, match="'0.missing'"):
        set_module_tensor_to_device(model, "0.missing.weight", "cpu", value=torch.zeros(1))


def test_move_to_meta_and_back_keeps_requires_grad():
    layer = nn.Linear(2, 2)
    layer.weight.requires_grad_(False)
    set_module_tensor_to_device(layer, "weight", "meta")
    assert layer.weight.device.type == "meta" and not layer.weight.requires_grad


def _tied_model():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.Linear(4, 10, bias=False))
    model[2].weight = model[0].weight
    return model


def test_find_and_retie():
    model = _tied_model()
    assert find_tied_parameters(model) == [["0.weight", "2.weight"]]
    with init_empty_weights():
        meta = _tied_model()
    assert find_tied_parameters(meta) == [["0.weight", "2.weight"]]
    set_module_tensor_to_device(meta, "0.weight", "cpu", value=torch.ones(10, 4))
    assert meta[2].weight.device.type == "meta"
    retie_parameters(meta, [["0.weight", "2.weight"]])
    assert meta[2].weight is meta[0].weight
    assert find_tied_parameters(nn.Linear(2, 2)) == []


def test_check_tied_on_same_device_warns(caplog):
    check_tied_parameters_on_same_device([["0.weight", "2.weight"]], {"0": "cpu", "2": 0})
    assert "0.weight" in caplog.text and "different devices" in caplog.text
    caplog.clear()
    check_tied_parameters_on_same_device([["0.weight", "2.weight"]], {"": "cpu"})
    assert caplog.text == ""


def test_get_module_size_with_ties():
    modules = [("1", None), ("2", None)]
    sizes = {"0": 160, "0.weight": 160, "1": 80, "2": 160, "2.weight": 160}
    total, names, _ = get_module_size_with_ties(["2.weight"], 160, sizes, modules)
    assert (total, names) == (160, ["2"])
    assert get_module_size_with_ties([], 5, sizes, modules) == (5, [], [])


def test_tied_params_map_reuses_the_copy_in_the_right_slot():
    module = nn.Module()
    module.register_buffer("b", torch.zeros(2))
    source = torch.ones(2)
    cached = torch.full((2,), 7.0)
    tied = {source.data_ptr(): {torch.device("cpu"): cached}}
    set_module_tensor_to_device(module, "b", "cpu", value=source, tied_params_map=tied)
    assert module._buffers["b"] is cached and "b" not in module._parameters
    with pytest.raises(ValueError, match=r"'b' has shape \(3,\)"):
        set_module_tensor_to_device(module, "b", "cpu", value=torch.ones(3), tied_params_map=tied)
