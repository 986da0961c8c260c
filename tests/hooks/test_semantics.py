"""An offloaded module behaves like the plain module (issue 12): what a user changes after
offloading (requires_grad, dtype, the forward itself, a traced graph) is honoured; copies,
inference mode, re-offloading and tied weights work as on the plain model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.fx
from torch import nn

from bigmodel import (
    align_module_device,
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    remove_hook_from_submodules,
)


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.block = Block()
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(self.block(self.embed(ids)))


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
IDS = torch.tensor([[1, 4, 9, 2]])
CPU_DISK = {"a": "cpu", "b": "disk", "c": "cpu"}


def offloaded(kind: str, model: nn.Module, tmp_path) -> nn.Module:
    """``model`` offloaded one of the ways a user can."""
    if kind == "cpu_offload":
        return cpu_offload(model)
    if kind == "disk_offload":
        return disk_offload(model, tmp_path / "offload")
    return dispatch_model(model, CPU_DISK, offload_dir=tmp_path / "offload")


KINDS = ["cpu_offload", "disk_offload", "dispatch"]


@pytest.mark.parametrize("kind", KINDS)
def test_requires_grad_false_after_offload_is_honoured(kind, tmp_path):
    model = offloaded(kind, Net(), tmp_path)
    model.requires_grad_(False)
    seen = []  # does the output of an offloaded layer (fed a frozen input) require grad?
    model.b.up.register_forward_hook(lambda module, args, output: seen.append(output.requires_grad))
    out = model(X)
    assert seen == [False]  # the weights the offloaded layer computes with are frozen too
    assert not out.requires_grad
    model.requires_grad_(True)
    assert model(X).requires_grad and seen[-1] is True
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("kind", KINDS)
def test_deepcopy_gives_an_independent_model_that_runs_as_itself(kind, tmp_path):
    plain = Net()
    ref = plain(X)
    model = offloaded(kind, Net(), tmp_path)
    model(X)
    model(X)  # the prefetcher has recorded its order
    clone = copy.deepcopy(model)
    assert torch.equal(clone(X), ref)
    # Change the copy (an offloaded layer and, where there is one, a resident layer): the copy
    # computes with its own weights, the original keeps its own.
    changed = copy.deepcopy(plain)
    for name in ("a.up", "b.up"):
        with torch.no_grad():
            changed.get_submodule(name).weight.mul_(-1)
        with align_module_device(clone.get_submodule(name)), torch.no_grad():
            clone.get_submodule(name).weight.mul_(-1)
    assert torch.equal(clone(X), changed(X))
    assert torch.equal(model(X), ref)
    assert clone.a.up._hf_hook is not model.a.up._hf_hook
    clone.double()  # the copy's own cast guard: the original stays float32
    assert torch.equal(clone(X.double()), copy.deepcopy(changed).double()(X.double()))
    assert torch.equal(model(X), ref)
    clone.float()
    remove_hook_from_submodules(clone)
    assert torch.equal(clone(X), changed(X))
    assert torch.equal(model(X), ref)


def test_edited_fx_graph_module_runs_its_new_graph_once_recompiled():
    traced = torch.fx.symbolic_trace(Net())
    ref = traced(X)
    cpu_offload(traced)
    assert torch.equal(traced(X), ref)
    output = next(node for node in traced.graph.nodes if node.op == "output")
    with traced.graph.inserting_before(output):
        doubled = traced.graph.call_function(torch.mul, (output.args[0], 2.0))
    output.args = (doubled,)
    traced.recompile()
    assert torch.equal(traced(X), ref * 2.0)


def test_forward_set_on_the_instance_keeps_its_signature_once_hooked():
    model = Net()

    def forward(x, scale: float = 1.0):
        return Net.forward(model, x) * scale

    model.forward = forward
    ref = model(X, scale=3.0)
    cpu_offload(model)
    assert inspect.signature(model.forward) == inspect.signature(forward)
    assert torch.equal(model(X, scale=3.0), ref)
    assert list(inspect.signature(model.a.forward).parameters) == ["x"]  # class forwards: bound, no self


@pytest.mark.parametrize("kind", KINDS)
def test_inference_mode_forward_then_autograd_forward(kind, tmp_path):
    plain = Net()
    plain(X).sum().backward()
    model = offloaded(kind, Net(), tmp_path)
    with torch.inference_mode():
        first = model(X)
    assert first.is_inference()
    out = model(X)
    assert not out.is_inference() and out.requires_grad
    out.sum().backward()
    assert torch.equal(out, plain(X))
    for name, param in model.named_parameters():
        if param.device.type != "meta":  # resident parameters get their gradients
            assert torch.equal(param.grad, plain.get_parameter(name).grad), name


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Conv2d(4, 4, 3)
        self.c = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


@pytest.mark.parametrize("cast", ["to_float64", "double", "bfloat16"])
def test_dtype_casts_of_a_dispatched_model_with_offloaded_modules(cast, tmp_path):
    plain = Net()
    model = dispatch_model(Net(), CPU_DISK, offload_dir=tmp_path)
    if cast == "to_float64":
        plain, model, x = plain.to(torch.float64), model.to(torch.float64), X.double()
    elif cast == "double":
        plain, model, x = plain.double(), model.double(), X.double()
    else:
        plain, model, x = plain.bfloat16(), model.bfloat16(), X.bfloat16()
    assert model is not None and model.b.up.weight.device.type == "meta"
    assert model.b.up.weight.dtype == plain.b.up.weight.dtype
    assert torch.equal(model(x), plain(x))
    assert {p.dtype for p in model.parameters()} == {p.dtype for p in plain.parameters()}


def test_memory_format_of_a_dispatched_model_with_offloaded_modules(tmp_path):
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    plain = Conv()
    ref = plain(x)
    model = dispatch_model(Conv(), CPU_DISK, offload_dir=tmp_path)
    model.to(memory_format=torch.channels_last)
    assert model.a.weight.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(model(x), ref, atol=1e-6)


def test_device_moves_of_a_dispatched_model_with_offloaded_modules_stay_refused(tmp_path):
    model = dispatch_model(Net(), CPU_DISK, offload_dir=tmp_path)
    with pytest.raises(RuntimeError, match=r"Cannot call \.to\(\).*'b\.up'.*remove_hook_from_submodules"):
        model.to("meta")
    assert torch.equal(model(X), Net()(X))  # a refused move changed nothing


@pytest.mark.parametrize("order", ["with_hook_then_cpu_offload", "cpu_offload_then_with_hook"])
def test_offloading_again_with_the_other_entry_point(order):
    ref = Net()(X)
    model = Net()
    if order == "with_hook_then_cpu_offload":
        model, hook = cpu_offload_with_hook(model, execution_device="cpu")
        assert torch.equal(model(X), ref)
        cpu_offload(model, execution_device="cpu")
    else:
        cpu_offload(model, execution_device="cpu")
        assert torch.equal(model(X), ref)
        model, hook = cpu_offload_with_hook(model, execution_device="cpu")
    assert torch.equal(model(X), ref)
    hook.offload()
    assert torch.equal(model(X), ref)


@pytest.mark.parametrize("kind", ["cpu_offload", "disk_offload"])
def test_tied_names_share_one_parameter_after_whole_model_offload(kind, tmp_path):
    ref = TiedLM()(IDS)
    model = TiedLM()
    if kind == "cpu_offload":
        cpu_offload(model)
    else:
        disk_offload(model, tmp_path)
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model(IDS), ref)
    assert model.lm_head.weight is model.embed.weight
    assert len(list(model.parameters())) == len(list(TiedLM().parameters()))
    remove_hook_from_submodules(model)
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model(IDS), ref)


class _NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.up(x))


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_cast_reaches_offloaded_buffers(offload: str, tmp_path) -> None:
    """``.to(float64)`` replaces buffer placeholders by new tensors (parameters are cast in place): the
    hooks load the offloaded buffers in the new dtype too (found by the differential harness)."""
    import bigmodel

    torch.manual_seed(0)
    plain = _NormNet().eval()
    x = torch.randn(2, 4, dtype=torch.float64)
    expected = copy.deepcopy(plain).double()(x)
    if offload == "cpu_offload":
        bigmodel.cpu_offload(plain, offload_buffers=True)
    else:
        bigmodel.disk_offload(plain, tmp_path, offload_buffers=True)
    plain.to(torch.float64)
    assert torch.equal(plain(x), expected)
    assert plain.norm.running_mean.dtype == torch.float64
