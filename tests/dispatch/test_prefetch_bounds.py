"""How much a prefetch to an accelerator holds on the device (simulated accelerator, tests/_fake_accelerator.py).

The planner (like accelerate's) keeps room on the execution device for one offloaded layer.  A
prefetch staging modules ahead onto the device holds memory the plan does not count, so it is
bounded: the modules staged ahead never hold more bytes than the largest offloaded module, at any
depth (depth 2 stages two modules only when they fit in that together).  Reading ahead on the CPU
(no device memory) is not bounded this way.
"""

from __future__ import annotations

import pytest
import torch
from _fake_accelerator import dispatch_as_accelerator, install
from torch import nn

from bigmodel import disk_offload


class Widths(nn.Module):
    """Linears of the given output widths, each followed by tanh (input width 64)."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        dims = [64, *widths]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


X = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fake(monkeypatch):
    backend = install(monkeypatch)
    dispatch_as_accelerator(monkeypatch)
    return backend


def _run(widths: list[int], depth: int, tmp_path, forwards: int = 8) -> tuple[list[int], int, list[int]]:
    """Offload a Widths model to disk, run it; returns (bytes staged ahead after each module start,
    the largest module's bytes, the number of modules staged ahead after each module start)."""
    torch.manual_seed(0)
    model = Widths(widths).eval()
    with torch.no_grad():
        expected = model(X)
    disk_offload(model, tmp_path, execution_device="cpu")
    hooks = {id(layer._hf_hook): layer._hf_hook for layer in model.layers}
    prefetcher = next(iter(hooks.values())).prefetcher
    prefetcher.depth, prefetcher.min_bytes = depth, 0
    ahead_bytes, ahead_count = [], []
    schedule = prefetcher.schedule_after

    def observed(hook):
        schedule(hook)
        ahead_bytes.append(sum(hooks[key].offloaded_bytes for key in prefetcher._pending))
        ahead_count.append(prefetcher.pending)

    prefetcher.schedule_after = observed
    with torch.no_grad():
        for _ in range(forwards):
            assert torch.equal(model(X), expected)
    return ahead_bytes, max(hook.offloaded_bytes for hook in hooks.values()), ahead_count


@pytest.mark.parametrize("depth", [1, 2])
def test_modules_staged_ahead_never_hold_more_than_the_largest_module(fake, depth, tmp_path):
    ahead_bytes, largest, counts = _run([64] * 6, depth, tmp_path)
    assert max(ahead_bytes) <= largest
    assert max(counts) == 1  # equal modules: one ahead, also at depth 2


def test_depth_two_stages_two_modules_when_they_fit_in_the_largest(fake, tmp_path):
    # 64->256 is the large module; the 16-wide ones are small enough for two to be staged together.
    ahead_bytes, largest, counts = _run([256, 16, 16, 16, 16, 64], 2, tmp_path)
    assert max(ahead_bytes) <= largest
    assert max(counts) == 2
