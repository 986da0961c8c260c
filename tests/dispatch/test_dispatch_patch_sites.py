"""dispatch_model calls check_device_map where the ecosystem patches it.

transformers replaces ``check_device_map`` on the big-modeling module while it dispatches
models with ``_no_placement_params``; code ported from the incumbent does the same on
``bigmodel.big_modeling``.  dispatch_model must call whatever is there at call time.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import bigmodel.big_modeling
from bigmodel import dispatch_model


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_patched_check_device_map_is_the_one_called(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(bigmodel.big_modeling, "check_device_map", lambda model, device_map: calls.append(device_map))
    model = Two()
    dispatch_model(model, {"a": "cpu", "b": "cpu"}, force_hooks=True)
    assert calls == [{"a": "cpu", "b": "cpu"}]


def test_skipping_the_check_lets_a_partial_map_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Two()
    with pytest.raises(ValueError, match=r"b\.weight"):
        dispatch_model(model, {"a": "cpu"}, force_hooks=True)
    monkeypatch.setattr(bigmodel.big_modeling, "check_device_map", lambda *args, **kwargs: None)
    x = torch.randn(2, 4)
    expected = model(x)
    dispatch_model(model, {"a": "cpu"}, force_hooks=True)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_after_the_patch_is_undone_the_check_runs_again(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(bigmodel.big_modeling, "check_device_map", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match=r"b\.weight"):
        dispatch_model(Two(), {"a": "cpu"}, force_hooks=True)
