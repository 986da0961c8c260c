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
"""

from __future__ import annotations

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


CASES = [
    Case("hook_overhead_linear", "per call, nn.Linear(576, 576) on 1x1x576, hooked vs plain",
         run, floor,
         (Metric("cpu_us", "cpu_offload'ed (weights in memory), µs per call", fmt="{:.1f}"),
          Metric("disk_us", "disk_offload'ed (offload folder, mmap), µs per call", fmt="{:.1f}"),
          Metric("plain_us", "plain module in the same process, µs per call", fmt="{:.1f}"),
          Metric("cpu_ratio", "cpu_offload'ed / plain, same process (floor col = 1)", budget=1.0, fmt="{:.2f}"),
          Metric("disk_ratio", "disk_offload'ed / plain, same process (floor col = 1)", budget=1.0, fmt="{:.2f}")),
         params={"calls": 200, "batches": 15}, timeout_s=120),
]
