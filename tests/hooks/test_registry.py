"""Hook registry: attaching, chaining and removing hooks; no reference cycles."""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
from torch import nn

from bigmodel import (
    ModelHook,
    SequentialHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)


class AddOne(ModelHook):
    def pre_forward(self, module, *args, **kwargs):
        return (args[0] + 1,) + args[1:], kwargs


class TimesTwo(ModelHook):
    def post_forward(self, module, output):
        return output * 2


class Counting(ModelHook):
    def __init__(self):
        self.events = []

    def init_hook(self, module):
        self.events.append("init")
        return module

    def detach_hook(self, module):
        self.events.append("detach")
        return module


class NoGrad(ModelHook):
    no_grad = True


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(3.0))

    def forward(self, x, bias=0.0):
        return x * self.w + bias


def test_pre_and_post_forward_change_inputs_and_outputs():
    module = Scale()
    add_hook_to_module(module, AddOne())
    assert module(torch.tensor(1.0)).item() == 6.0
    add_hook_to_module(module, TimesTwo())  # replaces AddOne
    assert module(torch.tensor(1.0)).item() == 6.0
    assert isinstance(module._hf_hook, TimesTwo)


def test_append_chains_hooks_in_order():
    module = Scale()
    add_hook_to_module(module, AddOne())
    add_hook_to_module(module, TimesTwo(), append=True)
    assert isinstance(module._hf_hook, SequentialHook)
    assert [type(h) for h in module._hf_hook.hooks] == [AddOne, TimesTwo]
    assert module(torch.tensor(1.0)).item() == 12.0  # (1 + 1) * 3 * 2
    add_hook_to_module(module, AddOne(), append=True)
    assert [type(h) for h in module._hf_hook.hooks] == [AddOne, TimesTwo, AddOne]


def test_remove_restores_exactly_what_was_there():
    module = Scale()
    before = dict(module.__dict__)
    counting = Counting()
    add_hook_to_module(module, counting)
    assert module._old_forward(torch.tensor(1.0)).item() == 3.0
    remove_hook_from_module(module)
    assert counting.events == ["init", "detach"]
    assert module.__dict__.keys() == before.keys()
    assert "forward" not in module.__dict__
    assert module.forward.__func__ is Scale.forward


def test_instance_forward_is_kept_and_restored():
    module = Scale()

    def custom(x, bias=0.0):
        return x - 1

    module.forward = custom
    add_hook_to_module(module, TimesTwo())
    assert module(torch.tensor(5.0)).item() == 8.0
    remove_hook_from_module(module)
    assert module.forward is custom


def test_replaced_old_forward_is_kept_on_removal():
    module = Scale()
    add_hook_to_module(module, ModelHook())

    def other(x, bias=0.0):
        return x + 100

    module._old_forward = other  # what some libraries do to a hooked module
    assert module(torch.tensor(1.0)).item() == 101.0
    remove_hook_from_module(module)
    assert module.forward is other


def test_no_grad_hook_runs_forward_without_grad():
    module = Scale()
    add_hook_to_module(module, ModelHook())
    assert module(torch.tensor(1.0)).requires_grad
    add_hook_to_module(module, NoGrad())
    assert not module(torch.tensor(1.0)).requires_grad
    assert SequentialHook(ModelHook(), NoGrad()).no_grad


def test_forward_signature_is_preserved():
    module = Scale()
    add_hook_to_module(module, ModelHook())
    assert list(inspect.signature(module.forward).parameters) == ["x", "bias"]
    assert module(torch.tensor(1.0), bias=1.0).item() == 4.0


def test_remove_recurse_and_submodules():
    model = nn.Sequential(Scale(), nn.Sequential(Scale(), Scale()))
    for module in model.modules():
        add_hook_to_module(module, TimesTwo())
    remove_hook_from_module(model[1], recurse=True)
    assert not any(hasattr(m, "_hf_hook") for m in model[1].modules())
    assert hasattr(model[0], "_hf_hook") and hasattr(model, "_hf_hook")
    remove_hook_from_submodules(model)
    assert not any(hasattr(m, "_hf_hook") or hasattr(m, "_old_forward") for m in model.modules())
    assert model(torch.tensor(1.0)).item() == 27.0


def test_hooked_module_is_freed_without_gc():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    for module in model.modules():
        add_hook_to_module(module, TimesTwo())
        add_hook_to_module(module, AddOne(), append=True)
    with torch.no_grad():
        model(torch.ones(1, 256))
    weight = weakref.ref(model[0].weight)
    gc.collect()
    gc.disable()
    try:
        del model, module
        assert weight() is None
    finally:
        gc.enable()


def test_hook_errors_propagate():
    class Boom(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            raise ValueError("boom in pre_forward")

    module = Scale()
    add_hook_to_module(module, Boom())
    with pytest.raises(ValueError, match="boom in pre_forward"):
        module(torch.tensor(1.0))


def _libraries():
    """bigmodel's hook API, and accelerate's where it is installed (the same calls must observe the same)."""
    import bigmodel.hooks

    libraries = [bigmodel.hooks]
    try:
        import accelerate.hooks
    except ImportError:
        pass
    else:
        libraries.append(accelerate.hooks)
    return libraries


@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__.split(".")[0])
def test_no_grad_set_on_a_sequential_hook_is_honoured(lib):
    module = Scale()
    lib.add_hook_to_module(module, lib.ModelHook())
    lib.add_hook_to_module(module, lib.ModelHook(), append=True)
    assert isinstance(module._hf_hook.hooks, tuple)
    assert module(torch.tensor(1.0)).requires_grad
    module._hf_hook.no_grad = True  # accelerate users switch a chain to no_grad this way
    assert not module(torch.tensor(1.0)).requires_grad
    assert module._hf_hook.no_grad is True


@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__.split(".")[0])
def test_hooking_again_after_the_forward_was_replaced_runs_the_new_hook(lib):
    module = Scale()
    lib.add_hook_to_module(module, lib.ModelHook())
    module.forward = lambda x, bias=0.0: x - 100  # replaces the hooked forward
    assert module(torch.tensor(1.0)).item() == -99.0
    lib.add_hook_to_module(module, TimesTwo())  # wraps the original forward again
    assert module(torch.tensor(1.0)).item() == 6.0  # (1 * 3) * 2
    lib.add_hook_to_module(module, AddOne(), append=True)
    assert module(torch.tensor(1.0)).item() == 12.0  # ((1 + 1) * 3) * 2
    lib.remove_hook_from_module(module)
    assert module(torch.tensor(1.0)).item() == 3.0


@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__.split(".")[0])
def test_hooked_forward_wraps_the_old_forward(lib):
    module = Scale()
    lib.add_hook_to_module(module, lib.ModelHook())
    assert module.forward.__wrapped__ == Scale.forward.__get__(module)
    assert inspect.unwrap(module.forward) == Scale.forward.__get__(module)
    assert module.forward.__qualname__ == "Scale.forward"
    assert module.forward.__name__ == "forward"


@pytest.mark.parametrize("lib", _libraries(), ids=lambda lib: lib.__name__.split(".")[0])
def test_torch_export_of_a_hooked_module(lib):
    module = Scale()
    x = torch.tensor([1.0, 2.0])
    lib.add_hook_to_module(module, lib.ModelHook())
    assert module._old_forward.__code__ is Scale.forward.__code__  # a bound method's function attributes
    exported = torch.export.export(module, (x,))  # reads module.forward.__code__ (before: AttributeError)
    torch.testing.assert_close(exported.module()(x), x * 3.0, rtol=0, atol=0)
