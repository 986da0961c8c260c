"""Quantized tensor subclasses (torchao) offloaded towards an accelerator (simulated: tests/_fake_accelerator.py).

With an accelerator as the execution device, CPU-offloaded values are pinned once and every
offloaded module is prefetched through side-stream copies (disk values through the pinned staging
ring).  A subclass goes through that path as its plain inner tensors: pinned in place of the
subclass, copied part by part, and rebuilt around the copies before the module's forward.
"""

from __future__ import annotations

import pytest
import torch
from _fake_accelerator import dispatch_as_accelerator, install
from _opaque_tensor import Opaque
from torch import nn

torchao_quantization = pytest.importorskip("torchao.quantization")

from bigmodel import cpu_offload, disk_offload, dispatch_model  # noqa: E402
from bigmodel.hooks.align_hook import offload_hook_of  # noqa: E402

Int8Tensor = torchao_quantization.Int8Tensor
X = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))


class Recording(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.__dict__["seen"] = self.weight
        return super().forward(x)


def quantized_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(3) for m in (Recording(64, 64), nn.ReLU())]).eval()
    torchao_quantization.quantize_(model, torchao_quantization.Int8WeightOnlyConfig())
    return model


@pytest.fixture
def fake(monkeypatch):
    backend = install(monkeypatch)
    dispatch_as_accelerator(monkeypatch)
    return backend


def _run_twice(fake, model: nn.Module, expected: torch.Tensor) -> None:
    with torch.no_grad():
        for _ in range(3):  # the first forward records the order, the next ones prefetch
            assert torch.equal(model(X), expected)
    for layer in model[0::2]:
        assert type(layer.seen) is Int8Tensor
    print("copies", fake.copies)
    assert fake.copies >= 3  # side-stream copies of plain inner tensors ran (a subclass cannot be staged whole)


def test_cpu_offload_pins_the_inner_tensors_and_copies_them(fake):
    model = quantized_model()
    with torch.no_grad():
        expected = model(X)
    cpu_offload(model, "cpu")
    stored = offload_hook_of(model[0]).weights_map["weight"]
    assert type(stored) is Int8Tensor
    assert all(fake.is_pinned(getattr(stored, n)) for n in stored.__tensor_flatten__()[0])
    _run_twice(fake, model, expected)


def test_dispatch_model_cpu_and_disk_entries_towards_an_accelerator(fake, tmp_path):
    model = quantized_model()
    with torch.no_grad():
        expected = model(X)
    dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "disk", "3": "disk", "4": "cpu", "5": "cpu"},
                   main_device="cpu", offload_dir=tmp_path)
    _run_twice(fake, model, expected)


def test_disk_offload_towards_an_accelerator(fake, tmp_path):
    model = quantized_model()
    with torch.no_grad():
        expected = model(X)
    disk_offload(model, tmp_path, execution_device="cpu")
    _run_twice(fake, model, expected)


def opaque_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    model[0].weight = nn.Parameter(Opaque(torch.randn(4, 4)), requires_grad=False)
    return model


@pytest.mark.parametrize("how", ["dispatch_model", "dispatch_model_state_dict", "cpu_offload"])
def test_a_subclass_that_cannot_be_split_is_refused_before_anything_is_pinned(fake, tmp_path, how):
    model = opaque_model()
    params = dict(model.named_parameters())
    with pytest.raises(TypeError, match=r"'0\.weight' is a _opaque_tensor\.Opaque tensor subclass whose values cannot "
                                        r"be pinned .*__tensor_flatten__.*keep its module on the accelerator"):
        if how == "cpu_offload":
            cpu_offload(model, "cpu")
        else:
            dispatch_model(model, {"0": "cpu", "1": "cpu", "2": "disk"}, main_device="cpu", offload_dir=tmp_path,
                           state_dict=model.state_dict() if how == "dispatch_model_state_dict" else None)
    assert fake.pinned == []  # no arena was pinned
    assert dict(model.named_parameters()) == params and type(model[0].weight) is Opaque
    assert not model[2].weight.is_pinned() and not model[0].bias.is_pinned()
    assert all(not hasattr(m, "_hf_hook") for m in model.modules())
    assert list(tmp_path.iterdir()) == []  # nothing written for the disk entry either
