"""``init_empty_weights`` / ``init_on_device`` leave ``nn.Module`` exactly as they found it.

Other libraries patch ``nn.Module.register_parameter`` too (accelerate's own context does,
and may have been open when bigmodel was imported).  Once the last bigmodel context exits,
the class holds the very functions it held before the first one opened; while it is open,
a function found there is still called.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from bigmodel import init_empty_weights, init_on_device

PATCHED = ("register_parameter", "register_buffer", "register_module")


def _class_state() -> dict[str, object]:
    return dict(vars(nn.Module))


def _torch_state() -> tuple[object, int]:
    return torch.get_default_device(), torch._C._len_torch_function_stack()


@pytest.fixture
def foreign_patch():
    """Install another library's pass-through register_parameter/register_buffer; yields the call log."""
    original_param, original_buffer = nn.Module.register_parameter, nn.Module.register_buffer
    calls: list[str] = []

    def register_parameter(module, name, param):
        calls.append(name)
        original_param(module, name, param)

    def register_buffer(module, name, tensor, persistent=True):
        calls.append(name)
        original_buffer(module, name, tensor, persistent=persistent)

    nn.Module.register_parameter = register_parameter
    nn.Module.register_buffer = register_buffer
    try:
        yield calls, register_parameter, register_buffer
    finally:
        nn.Module.register_parameter = original_param
        nn.Module.register_buffer = original_buffer


def test_class_and_torch_state_are_identical_after_the_context():
    before, torch_before = _class_state(), _torch_state()
    with init_empty_weights():
        nn.Linear(3, 4)
    with init_on_device("cpu", include_buffers=True):
        nn.BatchNorm1d(3)
    assert _class_state() == before
    assert _torch_state() == torch_before


def test_a_patch_found_at_entry_is_put_back_at_exit(foreign_patch):
    _, param_fn, buffer_fn = foreign_patch
    before = _class_state()
    with init_empty_weights(include_buffers=True):
        model = nn.BatchNorm1d(3)
    assert nn.Module.register_parameter is param_fn
    assert nn.Module.register_buffer is buffer_fn
    assert _class_state() == before
    assert model.weight.is_meta and model.running_mean.is_meta


def test_a_patch_found_at_entry_keeps_being_called_inside(foreign_patch):
    calls, _, _ = foreign_patch
    with init_empty_weights():
        model = nn.Linear(3, 4)
    assert calls == ["weight", "bias"]
    assert model.weight.is_meta and model.bias.is_meta


def test_nested_and_failing_contexts_restore_the_class(foreign_patch):
    before, torch_before = _class_state(), _torch_state()
    with pytest.raises(RuntimeError, match="boom"):
        with init_empty_weights():
            with init_on_device("cpu", include_buffers=True):
                with init_empty_weights(include_buffers=True):
                    raise RuntimeError("boom")
    assert _class_state() == before
    assert _torch_state() == torch_before


def test_overlapping_contexts_in_two_threads_restore_the_class_once_both_exit(foreign_patch):
    before = _class_state()
    entered, release = threading.Barrier(2), threading.Event()
    results: dict[str, bool] = {}

    def worker(name: str) -> None:
        with init_empty_weights():
            entered.wait(timeout=30)
            if name == "first":
                release.wait(timeout=30)
            results[name] = nn.Linear(2, 2).weight.is_meta

    first = threading.Thread(target=worker, args=("first",))
    second = threading.Thread(target=worker, args=("second",))
    first.start()
    second.start()
    second.join(timeout=30)
    assert nn.Module.register_parameter is not before["register_parameter"]  # "first" still inside
    release.set()
    first.join(timeout=30)
    assert results == {"first": True, "second": True}
    assert _class_state() == before


def test_importing_bigmodel_while_another_patch_is_active_does_not_make_it_permanent():
    """accelerate's init_empty_weights may be open when bigmodel is imported for the first time."""
    script = """
import torch
from torch import nn
true_original = nn.Module.register_parameter
def foreign(module, name, param):
    true_original(module, name, param)
nn.Module.register_parameter = foreign          # another library's context is open...
from bigmodel import init_empty_weights       # ...while bigmodel is imported
nn.Module.register_parameter = true_original   # ...and then it exits
with init_empty_weights():
    layer = nn.Linear(2, 2)
assert layer.weight.is_meta
assert nn.Module.register_parameter is true_original, nn.Module.register_parameter
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("name", PATCHED)
def test_no_attribute_is_added_to_the_class(name):
    had = name in vars(nn.Module)
    with init_empty_weights(include_buffers=True):
        nn.Linear(2, 2)
    assert (name in vars(nn.Module)) == had


@pytest.mark.parametrize("outer", ["accelerate", "bigmodel"])
def test_nested_with_accelerates_own_context_both_ways(outer):
    """The real incumbent's context, nested inside or around bigmodel's: both build on meta, nothing stays patched."""
    accelerate = pytest.importorskip("accelerate")
    before, torch_before = _class_state(), _torch_state()
    first, second = (accelerate.init_empty_weights, init_empty_weights)
    if outer == "bigmodel":
        first, second = second, first
    with first():
        outer_layer = nn.Linear(2, 2)
        with second():
            inner_layer = nn.Linear(2, 2)
        after_inner = nn.Linear(2, 2)
    assert outer_layer.weight.is_meta and inner_layer.weight.is_meta and after_inner.weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta
    assert _class_state() == before
    assert _torch_state() == torch_before
