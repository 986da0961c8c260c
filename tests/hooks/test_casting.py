"""Layerwise casting: fp8/bf16 storage, compute-dtype forwards, skip rules."""

from __future__ import annotations

import torch
from torch import nn

from bigmodel import (
    LayerwiseCastingHook,
    attach_layerwise_casting_hooks,
    remove_hook_from_submodules,
)
from bigmodel.utils.constants import SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.conv(x).transpose(1, 2)
        return self.head(torch.relu(self.proj(self.norm(h))))


def make():
    torch.manual_seed(0)
    return ConvNet().eval()


X = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(1))


def test_supported_layers_constant():
    assert SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING == (
        nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    )


def test_fp8_storage_output_within_fp8_tolerance():
    model = make()
    with torch.no_grad():
        expected = model(X)
    attach_layerwise_casting_hooks(model, torch.float8_e4m3fn, torch.float32)
    assert model.conv.weight.dtype == torch.float8_e4m3fn and model.proj.weight.dtype == torch.float8_e4m3fn
    assert model.norm.weight.dtype == torch.float32  # LayerNorm is not a supported layer
    seen = []
    original = model.proj._old_forward
    model.proj._old_forward = lambda x: (seen.append(model.proj.weight.dtype), original(x))[1]
    with torch.no_grad():
        out = model(X)
    assert seen == [torch.float32]
    assert model.proj.weight.dtype == torch.float8_e4m3fn
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0.15, rtol=0.15)
    assert not torch.equal(out, expected)  # storage really is fp8
    with torch.no_grad():
        assert torch.equal(model(X), out)  # fp8 → fp32 → fp8 round-trips exactly


def test_bf16_compute_dtype():
    model = make().to(torch.bfloat16)
    attach_layerwise_casting_hooks(model, torch.float8_e5m2, torch.bfloat16)
    with torch.no_grad():
        assert model(X.to(torch.bfloat16)).dtype == torch.bfloat16


def test_skip_patterns_and_classes():
    model = make()
    attach_layerwise_casting_hooks(model, torch.float8_e4m3fn, torch.float32, skip_modules_pattern=["^head$"],
                                   skip_modules_classes=[nn.Conv1d])
    assert model.head.weight.dtype == torch.float32 and not hasattr(model.head, "_hf_hook")
    assert model.conv.weight.dtype == torch.float32
    assert isinstance(model.proj._hf_hook, LayerwiseCastingHook)
    remove_hook_from_submodules(model)
    assert model.proj.weight.dtype == torch.float32 and not hasattr(model.proj, "_hf_hook")


def test_hook_keeps_parameter_objects():
    layer = nn.Linear(4, 4)
    param = layer.weight
    attach_layerwise_casting_hooks(layer, torch.bfloat16, torch.float32)
    layer(torch.ones(1, 4))
    assert layer.weight is param and param.dtype == torch.bfloat16
