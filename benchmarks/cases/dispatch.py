"""Load-and-dispatch with half the model on disk, and a forward with most layers on disk.

- ``dispatch_half_disk``: ``load_checkpoint_and_dispatch`` of the sharded safetensors
  checkpoint with the last decoder layers (about half of the bytes) mapped to ``disk``;
  timed until the call returns and the CPU part is resident.  Also: bytes written to the
  offload folder.  Floor: mapping and touching the CPU part of the shards; 0 bytes written.
- ``forward_disk_600mb``: the same load with a 600 MB CPU budget (embeddings, head and
  2 of 16 layers on cpu, 14 layers on disk), then one warm-up forward of 1x8 tokens
  and ``repeats`` timed forwards of 1x128 tokens (the best of them: the least disturbed
  by other work on the machine; the runner then takes the median over processes).
  Floor: the same forward with the whole model in memory and no hooks.  Peak anonymous
  RSS is measured over the forwards, above the process's RSS before the model was built,
  against the 600 MB budget.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import torch

from .. import fixtures
from ..measure import dir_bytes, probe, rss_now, touch_file_mmap, touch_tensors
from ._llama import (
    empty_llama,
    input_ids,
    names_on,
    plain_llama,
    resident_tensors,
    safetensors_names,
    safetensors_ranges,
)
from .base import Case, Metric, Metrics

CPU_BUDGET = 600 * 10**6


def run_load(lib: Any, params: dict[str, Any]) -> Metrics:
    model = empty_llama(lib)
    folder = fixtures.fresh_dir("offload")
    dispatch = lib.load_checkpoint_and_dispatch
    try:
        with probe() as p:
            dispatch(model, params["checkpoint"], device_map=params["device_map"], offload_folder=folder)
            touch_tensors(resident_tensors(model))
        written = dir_bytes(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"time_s": p.seconds, "written_mb": written / 1e6, "peak_anon_mb": p.peak_anon / 1e6}


def floor_load(params: dict[str, Any]) -> Metrics:
    with probe() as p:
        maps = []
        for path in fixtures.checkpoint_files("st"):
            cpu = names_on(params["device_map"], "cpu", safetensors_names(path))
            maps.append(touch_file_mmap(path, safetensors_ranges(path, cpu)))
    return {"time_s": p.seconds, "written_mb": 0.0, "peak_anon_mb": p.peak_anon / 1e6}


def _forwards(model, vocab: int, repeats: int, anon0: int) -> Metrics:
    ids = input_ids(vocab)
    with torch.no_grad():
        model(ids[:, :8])  # warm-up (8 tokens): first-call costs; lets an implementation learn the layer order
        times = []
        with probe() as p:
            for _ in range(repeats):
                t0 = time.perf_counter()
                logits = model(ids).logits
                times.append(time.perf_counter() - t0)
    peak_anon = p.start_anon + p.peak_anon - anon0
    return {"time_s": min(times), "peak_anon_mb": peak_anon / 1e6,
            "logits_sum": float(logits.double().sum())}


def run_forward(lib: Any, params: dict[str, Any]) -> Metrics:
    anon0 = rss_now()["anon"]
    model = empty_llama(lib)
    folder = fixtures.fresh_dir("offload")
    try:
        lib.load_checkpoint_and_dispatch(model, params["checkpoint"], device_map=params["device_map"],
                                         offload_folder=folder)
        return _forwards(model, fixtures.LLAMA_2GB["vocab_size"], params["repeats"], anon0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def floor_forward(params: dict[str, Any]) -> Metrics:
    anon0 = rss_now()["anon"]
    model = plain_llama()
    return _forwards(model, fixtures.LLAMA_2GB["vocab_size"], params["repeats"], anon0)


_CKPT = str(fixtures.CACHE / "llama-st" / "model.safetensors.index.json")

CASES = [
    Case("dispatch_half_disk", "load_checkpoint_and_dispatch, ~half of 2.0 GB on disk", run_load, floor_load,
         (Metric("time_s", "time (s)"), Metric("written_mb", "written to offload folder (MB)", fmt="{:.1f}"),
          Metric("peak_anon_mb", "peak anon RSS (MB)", fmt="{:.0f}")),
         params={"checkpoint": _CKPT, "device_map": "half_disk"}, needs=("llama",), warm_files="st"),
    Case("forward_disk_600mb", "forward 1x128 tokens, 600 MB CPU budget, 14/16 layers on disk",
         run_forward, floor_forward,
         (Metric("time_s", "time per forward (s)"),
          Metric("peak_anon_mb", "peak anon RSS during forwards (MB; floor col = CPU budget)",
                 budget=CPU_BUDGET / 1e6, fmt="{:.0f}")),
         params={"checkpoint": _CKPT, "device_map": "budget_600mb", "repeats": 2}, needs=("llama",),
         warm_files="st", timeout_s=420),
]
