"""A forward with 14/16 layers on disk, the page cache of those layers' bytes dropped before each one.

``forward_cold_600mb``: the 600 MB CPU budget load of ``forward_disk_600mb`` (embeddings,
head, norm and layers 0-1 on cpu; layers 2-15, 1.41 GB, on disk), one 1x8-token warm-up
forward, then ``repeats`` timed 1x128 forwards (the best kept), and before each of them the
disk layers' bytes are dropped from the page cache: the byte ranges of the disk-mapped tensors
in the checkpoint shards plus every file of the offload folder (accelerate's ``.dat`` copies),
unmapped from the process first (see :mod:`benchmarks.pagecache`).  Never a global drop.

Rows: the time per cold forward; the cold sequential read of the disk layers' bytes the
implementation reads (its offload folder's files if it wrote any, else the shards' ranges; 8 MiB
reads, measured in the same process, just before each forward); their ratio per forward (the
storage's speed drifts between processes, so this is the ratio to judge); the fraction of those pages still
cached right after a drop (0 = the drop worked).  Floor: max(cold sequential read of the disk
layers' byte ranges of the shards, in-memory forward of the whole model without hooks).
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .. import fixtures, pagecache
from ._llama import (
    empty_llama,
    input_ids,
    names_on,
    plain_llama,
    safetensors_names,
    safetensors_ranges,
)
from .base import Case, Metric, Metrics

VOCAB = fixtures.LLAMA_2GB["vocab_size"]


def disk_ranges(device_map: dict[str, str], offload_folder: str | None) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges holding the disk-mapped weights: in the shards, and every file of ``offload_folder``."""
    ranges = {}
    for path in fixtures.checkpoint_files("st") if device_map else []:
        spans = safetensors_ranges(path, names_on(device_map, "disk", safetensors_names(path)))
        if spans:
            ranges[str(path)] = pagecache.merge(spans)
    if offload_folder is not None:
        files = [p for p in Path(offload_folder).rglob("*") if p.is_file() and p.suffix != ".json"]
        ranges.update(pagecache.whole_files(files))
    return ranges


def _cold_forwards(model, ranges, source, repeats: int) -> Metrics:
    """Per repeat: a cold sequential read of ``source``, then a forward with ``ranges`` dropped: the two
    side by side, as the storage's speed drifts from minute to minute on a shared disk."""
    ids = input_ids(VOCAB)
    with torch.no_grad():
        model(ids[:, :8])  # warm-up: first-call costs; lets an implementation learn the layer order
        times, reads, left = [], [], []
        for _ in range(repeats):
            read_s, nbytes = pagecache.read_cold(source)
            reads.append(read_s)
            pagecache.drop(ranges)
            left.append(pagecache.cached_fraction(ranges))
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
    return {"time_s": min(times), "cold_read_s": statistics.median(reads),
            "vs_cold_read": statistics.median(t / r for t, r in zip(times, reads)), "disk_gb": nbytes / 1e9,
            "cached_after_drop": max(left), "logits_sum": float(logits.double().sum())}


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    model = empty_llama(lib)
    folder = fixtures.fresh_dir("offload")
    try:
        lib.load_checkpoint_and_dispatch(model, params["checkpoint"], device_map=params["device_map"],
                                         offload_folder=folder)
        ranges = disk_ranges(params["device_map"], folder)
        written = disk_ranges({}, folder)  # the offload folder's files (accelerate's .dat copies), if any
        return _cold_forwards(model, ranges, written or disk_ranges(params["device_map"], None), params["repeats"])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def floor(params: dict[str, Any]) -> Metrics:
    ranges = disk_ranges(params["device_map"], None)
    read_s, nbytes = pagecache.read_cold(ranges)
    model = plain_llama()
    ids = input_ids(VOCAB)
    with torch.no_grad():
        model(ids[:, :8])
        times = []
        for _ in range(params["repeats"]):
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
    return {"time_s": max(read_s, min(times)), "cold_read_s": read_s, "vs_cold_read": max(read_s, min(times)) / read_s,
            "disk_gb": nbytes / 1e9,
            "memory_forward_s": min(times), "logits_sum": float(logits.double().sum())}


_CKPT = str(fixtures.CACHE / "llama-st" / "model.safetensors.index.json")

CASES = [
    Case("forward_cold_600mb", "cold-cache forward 1x128, 600 MB CPU budget, 14/16 layers on disk",
         run, floor,
         (Metric("time_s", "time per forward, disk layers dropped from the page cache first (s; "
                           "floor = max(cold read, in-memory forward))"),
          Metric("cold_read_s", "cold sequential read of the disk layers' bytes, same process, just before "
                                "each forward (s, median)"),
          Metric("vs_cold_read", "time per forward / the cold read just before it, same process (median; "
                                 "floor: max(cold read, in-memory forward) / cold read)", fmt="{:.2f}"),
          Metric("disk_gb", "disk layers' bytes (GB)", fmt="{:.2f}"),
          Metric("cached_after_drop", "fraction of those pages cached right after the drop", fmt="{:.3f}")),
         params={"checkpoint": _CKPT, "device_map": "budget_600mb", "repeats": 3}, needs=("llama",),
         warm_files="st", quick=False, timeout_s=600),
]
