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


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.register_buffer("scale", torch.ones(2))


@pytest.mark.parametrize(("value", "on_meta"), [("1", True), ("true", True), ("YES", True), ("0", False), ("off", False)])
def test_include_buffers_none_reads_accelerates_environment_variable(monkeypatch, value, on_meta):
    # accelerate 1.15: include_buffers=None means ACCELERATE_INIT_INCLUDE_BUFFERS (a deployment setting)
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", value)
    with init_empty_weights():
        built = _WithBuffer()
    with init_on_device(torch.device("meta")):
        built_on = _WithBuffer()
    assert built.linear.weight.is_meta and built_on.linear.weight.is_meta
    assert built.scale.is_meta is on_meta and built_on.scale.is_meta is on_meta
    with init_empty_weights(include_buffers=False):  # an explicit argument wins over the variable
        explicit = _WithBuffer()
    assert not explicit.scale.is_meta


def test_include_buffers_variable_that_is_not_a_boolean_is_refused_before_anything_changes(monkeypatch):
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "sometimes")
    register = nn.Module.register_parameter
    refused = pytest.raises(ValueError, match=r"ACCELERATE_INIT_INCLUDE_BUFFERS='sometimes' is not a boolean; set it to")
    with refused, init_empty_weights():
        pass
    assert nn.Module.register_parameter is register  # no patch left behind
    with init_empty_weights(include_buffers=True):  # an explicit value does not read it
        assert _WithBuffer().scale.is_meta


def test_include_buffers_variable_on_a_real_llama(monkeypatch):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "1")
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    assert all(b.is_meta for b in model.buffers()) and all(p.is_meta for p in model.parameters())
    monkeypatch.delenv("ACCELERATE_INIT_INCLUDE_BUFFERS")
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    assert not any(b.is_meta for b in model.buffers())


def test_lowercase_b_sizes_are_bytes_and_the_difference_with_accelerate_is_logged_once(caplog):
    # accelerate 1.15 reads "10gb" as 10 gigabits (1.25e9 bytes); bigmodel keeps bytes (the API
    # contract: units case-insensitive) and warns once per spelling, so a budget tuned for
    # accelerate is not silently eight times larger.
    from bigmodel.utils import convert_file_size_to_int, get_max_memory

    with caplog.at_level("WARNING", logger="bigmodel.core.sizes"):
        assert convert_file_size_to_int("12gb") == 12 * 10**9
        budgets = {"cpu": "12gb", "disk": "3Mb"}
        assert get_max_memory(budgets) == {"cpu": 12 * 10**9, "disk": 3 * 10**6}
        assert convert_file_size_to_int("12GB") == convert_file_size_to_int("12gib") // 2**30 * 10**9
        assert convert_file_size_to_int("7gib") == 7 * 2**30  # binary units: no bits reading anywhere
    messages = [r.getMessage() for r in caplog.records]
    tail = "accelerate reads a unit ending in a lowercase 'b' as bits"
    end = "to keep this meaning without the warning."
    assert messages == [
        f"Size '12gb' is read as 12000000000 bytes; {tail} (1500000000 bytes). Write '12GB' {end}",
        f"Size '3Mb' is read as 3000000 bytes; {tail} (375000 bytes). Write '3MB' {end}",
    ]


def test_get_max_layer_size_takes_one_no_split_class_as_a_string():
    # accelerate 1.15 gives the decoder layers here (a class name equal to the string matches);
    # reading the string as a set of characters made every leaf a layer instead.
    transformers = pytest.importorskip("transformers")
    from bigmodel.utils import compute_module_sizes, get_max_layer_size

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    sizes = compute_module_sizes(model)
    children = list(model.named_children())
    layers = (sizes["model.layers.0"], ["model.layers.0", "model.layers.1"])
    assert get_max_layer_size(children, sizes, "LlamaDecoderLayer") == layers
    assert get_max_layer_size(children, sizes, ["LlamaDecoderLayer"]) == layers


@pytest.mark.parametrize("library", ["accelerate", "bigmodel"])
def test_a_tensor_name_the_module_lacks_is_a_value_error(library):
    """accelerate 1.15 raises ValueError for a module that has no tensor of that name (code catches it)."""
    import importlib

    set_tensor = importlib.import_module(f"{library}.utils").set_module_tensor_to_device
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="nothere"):
        set_tensor(model, "0.nothere", "cpu", value=torch.ones(4))
    with pytest.raises(ValueError, match="nothere"):
        set_tensor(model, "nothere", "cpu", value=torch.ones(4))
    with pytest.raises(AttributeError):  # a missing submodule: AttributeError in both
        set_tensor(model, "1.weight", "cpu", value=torch.ones(4))
    assert sorted(name for name, _ in model.named_parameters()) == ["0.bias", "0.weight"]  # nothing added


@pytest.mark.parametrize("library", ["accelerate", "bigmodel"])
def test_module_sizes_read_zero_for_modules_without_tensors(library):
    """accelerate 1.15 returns a defaultdict(int): ``sizes[name]`` of every named module works (0 bytes for
    an activation or a dropout), so code walking ``named_modules()`` reads it without ``.get``."""
    import importlib

    sizes_of = importlib.import_module(f"{library}.utils").compute_module_sizes
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Dropout(), nn.Linear(4, 2, bias=False)))
    sizes = sizes_of(model)
    assert {name: sizes[name] for name, _ in model.named_modules()} == {"": 112, "0": 80, "1": 0, "2": 32, "2.0": 0, "2.1": 32}
    assert sizes["0.weight"] == 64 and sizes["not.a.module"] == 0
