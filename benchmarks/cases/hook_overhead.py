"""Per-call cost of a hooked module: one ``nn.Linear`` forward, hooked vs plain.

A decode step runs every hooked module once with a tiny input, so the Python work of the
hook (entry, putting the offloaded values in, taking them out again) is paid per module per
token.  This case isolates it on an ``nn.Linear(576, 576)`` (SmolLM2's hidden size) with a
decode-shaped input of 1x1x576:

- ``cpu_us``: the module under the library's ``cpu_offload(..., execution_device="cpu")``
  (weights kept in memory, an offloading hook per call);
- ``disk_us``: the module under ``disk_offload(..., execution_device="cpu")`` (weights in an
  offload folder, read through the library's weights loader: an mmap view per call);
- ``*_ratio``: the hooked time over the plain module's time measured in the same process.

Each value is the median over ``batches`` batches of ``calls`` forwards (time per call, µs).
Floor: the plain ``nn.Linear`` (its ratio is 1 by definition).

``hook_overhead_block`` does the same for one decoder layer shaped like SmolLM2's (two RMS
norms, q/k/v/o and gate/up/down projections, 576 → 1536; no attention kernel, so the layer's
own compute is small and the hook work shows), dispatched with ``dispatch_model`` as block
``layers.0`` of a two-layer model running on the CPU, the other layer in memory:

- ``disk_block_us``: ``layers.0`` mapped to ``disk`` (offloaded: its 7 Linears and 2 norms
  get their weights from the offload folder at each call);
- ``cpu_block_us``: ``layers.0`` mapped to ``cpu`` (resident: hooks only move inputs);
- ``*_ratio``: over the plain layer's time measured in the same process.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any

import torch
from torch import nn

from .. import fixtures
from .base import Case, Metric, Metrics

HIDDEN = 576


def _per_call_us(module: nn.Module, x: torch.Tensor, calls: int, batches: int) -> float:
    """Median over ``batches`` of the mean time of ``calls`` forwards, in microseconds."""
    times = []
    with torch.no_grad():
        for _ in range(max(3, calls // 10)):  # warm-up (first-call costs, prefetch order)
            module(x)
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(calls):
                module(x)
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(HIDDEN, HIDDEN).eval()


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    torch.set_num_threads(1)
    x = torch.randn(1, 1, HIDDEN)
    calls, batches = params["calls"], params["batches"]
    plain = _per_call_us(_linear(), x, calls, batches)
    cpu = _per_call_us(lib.cpu_offload(_linear(), execution_device="cpu"), x, calls, batches)
    folder = fixtures.fresh_dir("hook-offload")
    try:
        disk = _per_call_us(lib.disk_offload(_linear(), folder, execution_device="cpu"), x, calls, batches)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"cpu_us": cpu, "disk_us": disk, "plain_us": plain, "cpu_ratio": cpu / plain, "disk_ratio": disk / plain}


def floor(params: dict[str, Any]) -> Metrics:
    torch.set_num_threads(1)
    plain = _per_call_us(_linear(), torch.randn(1, 1, HIDDEN), params["calls"], params["batches"])
    return {"cpu_us": plain, "disk_us": plain, "plain_us": plain}


class _Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


class _Layer(nn.Module):
    """A decoder layer's modules and data flow (no attention over past tokens: one query attends to itself)."""

    def __init__(self, dim: int = HIDDEN, kv: int = 192, hidden: int = 1536) -> None:
        super().__init__()
        self.input_norm, self.post_norm = _Norm(dim), _Norm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False), nn.Linear(dim, kv, bias=False),
                                          nn.Linear(dim, kv, bias=False), nn.Linear(dim, dim, bias=False))
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.input_norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        x = x + self.o(q * (k.sum() + v.sum()))
        h = self.post_norm(x)
        return x + self.down(torch.nn.functional.silu(self.gate(h)) * self.up(h))


class _TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](self.layers[0](x))


def _two_layers() -> _TwoLayers:
    torch.manual_seed(0)
    return _TwoLayers().eval()


def run_block(lib: Any, params: dict[str, Any]) -> Metrics:
    torch.set_num_threads(1)
    x = torch.randn(1, 1, HIDDEN)
    calls, batches = params["calls"], params["batches"]
    plain = _per_call_us(_two_layers().layers[0], x, calls, batches)
    folder = fixtures.fresh_dir("hook-block")
    try:
        out = {}
        for key, device in (("disk_block_us", "disk"), ("cpu_block_us", "cpu")):
            device_map = {"layers.0": device, "layers.1": "disk" if device == "cpu" else "cpu"}
            model = lib.dispatch_model(_two_layers(), device_map, main_device="cpu",
                                       offload_dir=os.path.join(folder, key), force_hooks=True)
            model(x)  # first forward (prefetch order)
            out[key] = _per_call_us(model.layers[0], x, calls, batches)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {**out, "plain_block_us": plain, "disk_block_ratio": out["disk_block_us"] / plain,
            "cpu_block_ratio": out["cpu_block_us"] / plain}


def floor_block(params: dict[str, Any]) -> Metrics:
    torch.set_num_threads(1)
    plain = _per_call_us(_two_layers().layers[0], torch.randn(1, 1, HIDDEN), params["calls"], params["batches"])
    return {"disk_block_us": plain, "cpu_block_us": plain, "plain_block_us": plain}


CASES = [
    Case("hook_overhead_linear", "per call, nn.Linear(576, 576) on 1x1x576, hooked vs plain",
         run, floor,
         (Metric("cpu_us", "cpu_offload'ed (weights in memory), µs per call", fmt="{:.1f}"),
          Metric("disk_us", "disk_offload'ed (offload folder, mmap), µs per call", fmt="{:.1f}"),
          Metric("plain_us", "plain module in the same process, µs per call", fmt="{:.1f}"),
          Metric("cpu_ratio", "cpu_offload'ed / plain, same process (floor col = 1)", budget=1.0, fmt="{:.2f}"),
          Metric("disk_ratio", "disk_offload'ed / plain, same process (floor col = 1)", budget=1.0, fmt="{:.2f}")),
         params={"calls": 200, "batches": 15}, timeout_s=120),
    Case("hook_overhead_block", "per call, a SmolLM2-shaped decoder layer (7 Linears, 2 norms) on 1x1x576, "
         "a block of a dispatched model vs plain", run_block, floor_block,
         (Metric("disk_block_us", "mapped to disk (offloaded), µs per call", fmt="{:.1f}"),
          Metric("cpu_block_us", "mapped to cpu (resident, hooked), µs per call", fmt="{:.1f}"),
          Metric("plain_block_us", "plain layer in the same process, µs per call", fmt="{:.1f}"),
          Metric("disk_block_ratio", "disk block / plain, same process (floor col = 1)", budget=1.0, fmt="{:.2f}"),
          Metric("cpu_block_ratio", "cpu block / plain, same process (floor col = 1)", budget=1.0, fmt="{:.2f}")),
         params={"calls": 100, "batches": 15}, timeout_s=180),
]
