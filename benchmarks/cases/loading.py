"""Load the 2 GB checkpoint to CPU until every weight is resident; safetensors and .bin.

The timed block is ``load_checkpoint_in_model(model, ckpt, device_map={"": "cpu"})`` on
a meta model, then one byte read per 4 KiB page of every tensor (a lazily mapped weight
counts only once its pages are in).  Floors, from a warm page cache: safetensors: map
every shard and read one byte per page; .bin: a bare ``torch.load(mmap=True,
weights_only=True)`` plus the same page reads.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import fixtures
from ..measure import probe, touch_file_mmap, touch_tensors
from ._llama import empty_llama
from .base import Case, Metric, Metrics


def _metrics(p) -> Metrics:
    return {"time_s": p.seconds, "peak_rss_mb": p.peak_rss / 1e6, "peak_anon_mb": p.peak_anon / 1e6}


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    model = empty_llama(lib)
    load = lib.load_checkpoint_in_model
    with probe() as p:
        load(model, params["checkpoint"], device_map={"": "cpu"})
        touch_tensors(model.state_dict().values())
    return _metrics(p)


def floor(params: dict[str, Any]) -> Metrics:
    with probe() as p:
        if params["format"] == "st":
            maps = [touch_file_mmap(path) for path in fixtures.checkpoint_files("st")]
        else:
            state = torch.load(params["checkpoint"], mmap=True, weights_only=True)
            touch_tensors(state.values())
    return _metrics(p)


_ROWS = (Metric("time_s", "time (s)"), Metric("peak_rss_mb", "peak RSS (MB)", fmt="{:.0f}"),
         Metric("peak_anon_mb", "peak anon RSS (MB)", fmt="{:.0f}"))

CASES = [
    Case("load_cpu_safetensors", "load to CPU, every page resident, sharded safetensors 2.0 GB", run, floor, _ROWS,
         params={"format": "st", "checkpoint": str(fixtures.CACHE / "llama-st" / "model.safetensors.index.json")},
         needs=("llama",), warm_files="st"),
    Case("load_cpu_bin", "load to CPU, every page resident, pytorch_model.bin 2.0 GB", run, floor, _ROWS,
         params={"format": "bin", "checkpoint": str(fixtures.CACHE / "llama-bin" / "pytorch_model.bin")},
         needs=("llama",), warm_files="bin"),
]
