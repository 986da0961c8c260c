import torch
from torch import nn
from torch.nn.utils import parametrize

from bigmodel import init_empty_weights, init_on_device


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.register_buffer("inv_freq", torch.arange(4, dtype=torch.float32))


def test_parameters_on_meta_buffers_real():
    with init_empty_weights():
        model = WithBuffer()
    assert model.proj.weight.device.type == "meta"
    assert isinstance(model.proj.weight, nn.Parameter)
    assert model.inv_freq.device.type == "cpu"
    assert torch.equal(model.inv_freq, torch.arange(4, dtype=torch.float32))


def test_include_buffers():
    with init_empty_weights(include_buffers=True):
        model = WithBuffer()
    assert model.inv_freq.device.type == "meta"
    assert model.proj.bias.device.type == "meta"


def test_ties_made_inside_context_stay_ties():
    with init_empty_weights():
        a = nn.Embedding(10, 4)
        b = nn.Linear(4, 10, bias=False)
        b.weight = a.weight
    assert a.weight is b.weight
    assert a.weight.device.type == "meta"


def test_requires_grad_kept():
    with init_empty_weights():
        layer = nn.Linear(2, 2)
        layer.bias = nn.Parameter(torch.zeros(2), requires_grad=False)
    assert layer.weight.requires_grad and not layer.bias.requires_grad
    assert layer.bias.device.type == "meta"


def test_context_restores_registration():
    register = nn.Module.register_parameter
    with init_empty_weights():
        pass
    assert nn.Module.register_parameter is register
    assert nn.Linear(2, 2).weight.device.type == "cpu"


def test_nesting_inner_wins_and_outer_resumes():
    with init_on_device("cpu"):
        outer_before = nn.Linear(2, 2)
        with init_empty_weights():
            inner = nn.Linear(2, 2)
        outer_after = nn.Linear(2, 2)
    assert outer_before.weight.device.type == "cpu"
    assert inner.weight.device.type == "meta"
    assert outer_after.weight.device.type == "cpu"
    assert nn.Linear(1, 1).weight.device.type == "cpu"


class Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def test_parametrized_module():
    with init_empty_weights():
        layer = nn.Linear(3, 3)
        parametrize.register_parametrization(layer, "weight", Symmetric())
    assert layer.parametrizations.weight.original.device.type == "meta"
    assert layer.weight.device.type == "meta"
    assert layer.weight.shape == (3, 3)


def test_exception_inside_context_restores():
    register = nn.Module.register_parameter
    try:
        with init_empty_weights():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert nn.Module.register_parameter is register
