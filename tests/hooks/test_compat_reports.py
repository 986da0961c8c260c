"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bigmodel import cpu_offload
from bigmodel.utils import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    align_module_device,
    set_module_tensor_to_device,
)


class _Scaled(nn.Linear):
    """A Linear whose forward multiplies by ``scale`` once a quantizer registered one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out * self.scale if hasattr(self, "scale") else out


def _register_offload_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """What compressed-tensors' ``register_offload_parameter`` does on an offloaded module
    (llm-compressor adds quantization scales this way to models loaded with a device map)."""
    hook = module._hf_hook
    module.register_parameter(name, param)
    weights_map = hook.weights_map
    if isinstance(weights_map, PrefixedDataset):
        dataset = weights_map.dataset
        store = dataset.state_dict if isinstance(dataset, OffloadedWeightsLoader) else dataset
        store[weights_map.prefix + name] = param.data
    else:
        weights_map[name] = param.data
    set_module_tensor_to_device(module, name, "meta")
    hook.original_devices[name] = torch.device("cpu")


def test_a_parameter_registered_after_offload_is_loaded_from_the_weights_map():
    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    plain = model[0](x)
    cpu_offload(model, execution_device="cpu")
    _register_offload_parameter(model[0], "scale", nn.Parameter(torch.full((4,), 2.0), requires_grad=False))
    with align_module_device(model[0]):
        assert model[0].scale.tolist() == [2.0] * 4  # accelerate: the value from the weights map
    assert model[0].scale.is_meta
    torch.testing.assert_close(model[0](x), plain * 2.0, rtol=0, atol=0)


def test_old_forward_looks_like_the_original_bound_method():
    from bigmodel.hooks import ModelHook, add_hook_to_module

    layer = nn.Linear(2, 2)
    original = layer.forward
    add_hook_to_module(layer, ModelHook())
    assert layer._old_forward.__func__ is nn.Linear.forward and layer._old_forward.__self__ is layer
    assert layer._old_forward.__name__ == "forward"
    assert layer._old_forward == original and hash(layer._old_forward) == hash(original)


def test_a_parameter_registered_after_disk_offload_is_loaded_from_the_offload_loader(tmp_path):
    from bigmodel import dispatch_model

    torch.manual_seed(0)
    model = nn.Sequential(_Scaled(4, 4), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    plain = model(x)
    scaled = model[1](model[0](x) * 2.0)
    dispatch_model(model, {"0": "disk", "1": "cpu"}, offload_dir=tmp_path)
    torch.testing.assert_close(model(x), plain, rtol=0, atol=0)  # a forward before: prefetch order recorded
    _register_offload_parameter(model[0], "scale", nn.Parameter(torch.full((4,), 2.0), requires_grad=False))
    torch.testing.assert_close(model(x), scaled, rtol=0, atol=0)
    assert model[0].scale.is_meta


def _offloaded_device(module: nn.Module) -> torch.device:
    """compressed-tensors' ``get_offloaded_device``: the first key of the hook's weights map, read
    from the map's underlying dataset (accelerate's PrefixedDataset iterates the dataset's full keys)."""
    first_key = list(module._hf_hook.weights_map.keys())[0]
    return module._hf_hook.weights_map.dataset[first_key].device


@pytest.mark.parametrize("library", ["accelerate", "bigmodel"])
def test_weights_map_keys_are_the_datasets_full_names(library, tmp_path):
    import importlib

    lib = importlib.import_module(library)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    lib.cpu_offload(model, execution_device="cpu")
    weights_map = model[1]._hf_hook.weights_map
    assert sorted(weights_map.keys()) == ["1.bias", "1.weight"]
    assert weights_map["weight"].shape == (2, 4)  # lookups stay relative to the module
    assert _offloaded_device(model[1]) == torch.device("cpu")

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    lib.disk_offload(model, str(tmp_path / "offload"), execution_device="cpu")
    assert sorted(model[0]._hf_hook.weights_map) == ["0.bias", "0.weight"]
    assert _offloaded_device(model[0]) == torch.device("cpu")


def test_align_devices_hook_repr_reads_as_accelerates():
    import accelerate.hooks

    from bigmodel.hooks import AlignDevicesHook

    for kwargs in ({}, {"execution_device": "cpu", "offload": True}, {"execution_device": torch.device("cpu"), "skip_keys": "cache"}):
        assert repr(AlignDevicesHook(**kwargs)) == repr(accelerate.hooks.AlignDevicesHook(**kwargs))
    assert repr(AlignDevicesHook("cpu", io_same_device=True)) == (
        "AlignDevicesHook(execution_device=cpu, offload=False, io_same_device=True, offload_buffers=False, "
        "place_submodules=False, skip_keys=None)"
    )


class _ScaledBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * 2


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_ScaledBlock(), _ScaledBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_preload_classes_stop_the_execution_device_hooks_of_offloaded_blocks_only():
    # accelerate 1.15: a resident block of a preload class still gets execution-device hooks on its
    # submodules (blocks.1.proj below); an offloaded one does not (its weights load at its start).
    from bigmodel.hooks import attach_align_device_hook_on_blocks

    torch.manual_seed(0)
    model, x = _TwoBlocks(), torch.randn(2, 4)
    expected = model(x)
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    attach_align_device_hook_on_blocks(
        model, execution_device=dict.fromkeys(["blocks.0", "blocks.1"], "cpu"),
        offload={"blocks.0": True, "blocks.1": False}, weights_map=weights, preload_module_classes=["_ScaledBlock"],
    )  # fmt: skip
    hooked = sorted(name for name, module in model.named_modules() if hasattr(module, "_hf_hook"))
    assert hooked == ["", "blocks.0", "blocks.1", "blocks.1.proj"]
    assert not model.blocks[1].proj._hf_hook.offload
    assert torch.equal(model(x), expected)
    direct = nn.functional.linear(x, weights["blocks.1.proj.weight"], weights["blocks.1.proj.bias"])
    assert torch.equal(model.blocks[1].proj(x), direct)
