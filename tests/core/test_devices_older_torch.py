"""torch 2.7-2.9 (the supported floor is 2.7) have no ``torch.accelerator.get_memory_info`` /
``empty_cache``: budgets and cache release then go through the backend module (``torch.<type>``),
never silently assume the accelerator has the host's RAM."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from bigmodel.core import devices

GIB = 2**30


def _older_torch(monkeypatch, backend: SimpleNamespace) -> None:
    monkeypatch.delattr(torch.accelerator, "get_memory_info", raising=False)
    monkeypatch.delattr(torch.accelerator, "empty_cache", raising=False)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(devices, "accelerator_type", lambda: "simulatedaccel")
    monkeypatch.setattr(torch, "simulatedaccel", backend, raising=False)


def test_memory_info_comes_from_the_backend_module_on_older_torch(monkeypatch):
    asked = []
    _older_torch(monkeypatch, SimpleNamespace(mem_get_info=lambda index: asked.append(index) or (5 * GIB, 8 * GIB)))
    assert devices.accelerator_memory_info(1) == (5 * GIB, 8 * GIB)
    assert asked == [1]


def test_memory_info_is_unknown_when_no_function_reports_it(monkeypatch):
    _older_torch(monkeypatch, SimpleNamespace())
    assert devices.accelerator_memory_info(0) is None


def test_empty_cache_goes_through_the_backend_module_on_older_torch(monkeypatch):
    released = []
    _older_torch(monkeypatch, SimpleNamespace(empty_cache=lambda: released.append(True)))
    devices.empty_cache(torch.device("cuda", 0))
    assert released == [True]
    devices.empty_cache(torch.device("cpu"))
    assert released == [True]
