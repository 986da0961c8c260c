"""Weights that already are quantized tensor subclasses (torchao) through dispatch, cpu_offload and disk_offload.

The hooks move the subclass itself: on the CPU the very tensor the model held (no copy, no
dequantized float copy), from disk its inner tensors memory-mapped from the offload folder and
rebuilt with ``__tensor_unflatten__``.  Outputs are bit-identical to the same quantized model run
without offload, for a plain ``nn.Sequential`` and a tiny transformers Llama.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from _opaque_tensor import Opaque
from torch import nn

torchao_quantization = pytest.importorskip("torchao.quantization")

from bigmodel import (  # noqa: E402
    cpu_offload,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from bigmodel.core.file_maps import is_mapped  # noqa: E402
from bigmodel.hooks.align_hook import offload_hook_of  # noqa: E402
from bigmodel.utils import compute_module_sizes  # noqa: E402

quantize_ = torchao_quantization.quantize_
Int8Tensor = torchao_quantization.Int8Tensor
X = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


class Recording(nn.Linear):
    """An nn.Linear (torchao quantizes it) that records the weight it computes with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.__dict__["seen"] = self.weight  # not registered as a parameter
        return super().forward(x)


def quantized_sequential(config=None, seed: int = 0, meta: bool = False) -> nn.Sequential:
    torch.manual_seed(seed)
    with init_empty_weights(include_buffers=True) if meta else torch.device("cpu"):
        model = nn.Sequential(Recording(64, 128), nn.ReLU(), Recording(128, 32)).eval()
    quantize_(model, config if config is not None else torchao_quantization.Int8WeightOnlyConfig())
    return model


def inner_bytes(weight: torch.Tensor) -> int:
    names, _ = weight.__tensor_flatten__()
    return sum(getattr(weight, n).numel() * getattr(weight, n).element_size() for n in names)


def test_sizes_count_the_quantized_bytes():
    model = quantized_sequential()
    sizes = compute_module_sizes(model)
    weight = model[0].weight
    assert sizes["0.weight"] == 128 * 64 + 128 * 4 + 128  # int8 data, float32 scale, int8 zero point per row
    assert sizes["0.weight"] == inner_bytes(weight) < weight.numel() * 4
    assert sizes[""] == inner_bytes(model[0].weight) + inner_bytes(model[2].weight) + (128 + 32) * 4
    assert compute_module_sizes(model, dtype=torch.float16)["0.weight"] == sizes["0.weight"]  # never cast


def test_infer_auto_device_map_plans_with_the_quantized_bytes():
    model = quantized_sequential()
    total = inner_bytes(model[0].weight) + inner_bytes(model[2].weight) + (128 + 32) * 4  # the bytes it holds
    device_map = infer_auto_device_map(model, max_memory={"cpu": total, "disk": 10**9})
    assert set(device_map.values()) == {"cpu"}  # float32 sizes (~4x) would send most of it to disk


def test_cpu_offload_moves_the_subclass_not_a_dequantized_copy():
    model = quantized_sequential()
    with torch.no_grad():
        expected = model(X)
    original = {i: model[i].weight.qdata.data_ptr() for i in (0, 2)}
    stored_bytes = inner_bytes(model[0].weight) + 128 * 4
    cpu_offload(model, "cpu")
    hook = offload_hook_of(model[0])
    assert hook.offloaded_bytes == stored_bytes  # what prefetch bounds count: the quantized bytes
    stored = hook.weights_map["weight"]
    assert type(stored) is Int8Tensor and stored.qdata.dtype == torch.int8  # RAM holds the quantized bytes
    assert model[0].weight.is_meta  # between forwards: a plain meta placeholder
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    for i in (0, 2):
        assert type(model[i].seen) is Int8Tensor
        assert model[i].seen.qdata.data_ptr() == original[i]  # the model's own int8 tensor, not a copy
    assert model[0].weight.is_meta


def test_disk_offload_stores_the_inner_tensors_with_no_pickle(tmp_path):
    model = quantized_sequential()
    with torch.no_grad():
        expected = model(X)
    qdata = model[0].weight.qdata.clone()
    disk_offload(model, tmp_path, execution_device="cpu")
    index = json.loads((tmp_path / "index.json").read_text())
    entry = index["0.weight"]
    assert entry["dtype"] == "float32" and entry["shape"] == [128, 64]
    assert entry["subclass"]["class"] == "torchao.quantization:Int8Tensor"
    assert entry["subclass"]["parts"]["qdata"] == {"dtype": "int8", "shape": [128, 64]}
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["index.json", "0.bias.dat", "2.bias.dat"]
        + [f"{i}.weight#{p}.dat" for i in (0, 2) for p in ("qdata", "scale", "zero_point")]
    )  # raw .dat files and JSON only: nothing pickled
    assert (tmp_path / "0.weight#qdata.dat").read_bytes() == qdata.numpy().tobytes()
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    seen = model[0].seen
    assert type(seen) is Int8Tensor and is_mapped(seen.qdata)  # a view of the offload folder's file


@pytest.mark.parametrize(
    "config",
    [
        "Int8WeightOnlyConfig()",
        "Int8DynamicActivationInt8WeightConfig()",  # a dataclass with an enum in the context
        "Float8WeightOnlyConfig()",  # float8 data, an enum in the context
        "IntxWeightOnlyConfig(weight_dtype=torch.int4)",  # a tuple in the context
    ],
)
def test_disk_offload_rebuilds_each_torchao_form_bit_identically(tmp_path, config):
    config = eval(config, {"torch": torch, **vars(torchao_quantization)})
    model = quantized_sequential(config)
    kind = type(model[0].weight)
    with torch.no_grad():
        expected = model(X)
    disk_offload(model, tmp_path, execution_device="cpu")
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    assert type(model[0].seen) is kind
    fresh = quantized_sequential(config, meta=True)  # built on meta: every value comes from the folder
    disk_offload(fresh, tmp_path, execution_device="cpu")
    with torch.no_grad():
        assert torch.equal(fresh(X), expected)


def test_a_second_disk_offload_reuses_the_folder_and_a_stale_one_is_rewritten(tmp_path):
    disk_offload(quantized_sequential(), tmp_path, execution_device="cpu")
    stamp = (tmp_path / "0.weight#qdata.dat").stat().st_mtime_ns
    again = quantized_sequential()
    disk_offload(again, tmp_path, execution_device="cpu")
    assert (tmp_path / "0.weight#qdata.dat").stat().st_mtime_ns == stamp  # same bytes: reused
    other = quantized_sequential(seed=1)
    with torch.no_grad():
        expected = other(X)
    disk_offload(other, tmp_path, execution_device="cpu")
    with torch.no_grad():
        assert torch.equal(other(X), expected)  # other weights: written again, never the stale ones


def test_dispatch_model_with_cpu_and_disk_entries(tmp_path):
    model = quantized_sequential()
    with torch.no_grad():
        expected = model(X)
    dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "disk"}, main_device="cpu", offload_dir=tmp_path)
    assert type(model[0].weight) is Int8Tensor and model[2].weight.is_meta
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    assert type(model[2].seen) is Int8Tensor and is_mapped(model[2].seen.qdata)


def test_a_subclass_that_cannot_be_flattened_is_refused_naming_the_module(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    model[0].weight = nn.Parameter(Opaque(torch.randn(4, 4)), requires_grad=False)
    with pytest.raises(TypeError, match=r"'0\.weight'.*Opaque.*__tensor_flatten__.*not 'disk'"):
        disk_offload(model, tmp_path / "off", execution_device="cpu")
    assert not (tmp_path / "off" / "index.json").exists()
    assert type(model[0].weight) is Opaque  # the model is left as it was


def test_a_context_that_would_need_pickling_is_refused(tmp_path):
    model = quantized_sequential()
    model[0].weight.block_size = [1, object()]  # something JSON cannot hold in __tensor_flatten__'s context
    with pytest.raises(TypeError, match=r"0\.weight.*pickling.*not 'disk'"):
        disk_offload(model, tmp_path, execution_device="cpu")
    assert not (tmp_path / "index.json").exists()


def test_offload_quantization_leaves_already_quantized_weights_as_they_are(tmp_path):
    model = quantized_sequential()
    with torch.no_grad():
        expected = model(X)
    disk_offload(model, tmp_path, execution_device="cpu", offload_quantization="int8")
    index = json.loads((tmp_path / "index.json").read_text())
    assert "subclass" in index["0.weight"] and "quantization" not in index["0.weight"]
    with torch.no_grad():
        assert torch.equal(model(X), expected)  # not quantized a second time
    assert type(model[0].seen) is Int8Tensor
