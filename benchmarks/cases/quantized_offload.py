"""Generate with SmolLM2-135M, half the decoder layers on disk, cold page cache: full precision vs quantized storage.

The offloaded part is stored as float32 (the checkpoint's dtype), float8, int8 or int4
(``offload_quantization``).  Before the prompt and after each generated token, the pages of
the offloaded bytes (the offload folder's files, and the checkpoint ranges the folder points
to) are dropped from the page cache: ``madvise(MADV_DONTNEED)`` on this process's own
mappings of them, then ``posix_fadvise(DONTNEED)`` on those files only (never a global
drop; the pages wholly inside those ranges: one shared with a layer in RAM stays), so every
token reads the offloaded weights from storage as with a model larger than RAM.  Rows: tokens/s of
a greedy 16-token generate after an 8-token prompt; bytes read from storage per generated token
(``read_bytes`` of ``/proc/self/io``, all threads of the process); the offload folder's size.
accelerate 1.15.0 stores offloaded weights in full precision only: it runs the float32 row.
Floor: the whole model in memory, no hooks.
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path
from typing import Any

import torch

from .. import fixtures, pagecache
from .base import Case, Metric, Metrics

NEW_TOKENS = 16
PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 2]
MB = 1e6

Ranges = dict[str, list[tuple[int, int]]]  # file -> [start, end) byte ranges


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def _safetensors_ranges(path: str, names: set[str]) -> list[tuple[int, int]]:
    """Absolute byte ranges of the tensors ``names`` in a safetensors file (from its header)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    return [(8 + size + header[n]["data_offsets"][0], 8 + size + header[n]["data_offsets"][1]) for n in names]


def offloaded_ranges(folder: str) -> Ranges:
    """What a forward reads from storage: every ``.dat`` of the folder, and the checkpoint ranges it points to."""
    ranges: Ranges = {str(p.resolve()): [(0, p.stat().st_size)] for p in Path(folder).glob("*.dat")}
    pointers: dict[str, set[str]] = {}
    for name, info in json.loads((Path(folder) / "index.json").read_text()).items():
        if "safetensors_file" in info:
            pointers.setdefault(str(Path(info["safetensors_file"]).resolve()), set()).add(info.get("weight_name", name))
    for path, names in pointers.items():
        ranges[path] = _safetensors_ranges(path, names)
    return ranges


def drop(ranges: Ranges) -> None:
    """Drop the ranges from the page cache (:func:`benchmarks.pagecache.drop`: this process's mappings first; only
    the pages wholly inside the merged ranges: a page shared with a tensor of a layer in RAM stays, as a real
    eviction of the offloaded bytes would leave it, else its page fault reads ``read_ahead_kb`` around it)."""
    pagecache.drop({path: pagecache.merge(spans) for path, spans in ranges.items()})


def _cold_generate(model, ranges: Ranges) -> Metrics:
    from transformers import StoppingCriteria, StoppingCriteriaList

    class DropAfterEachToken(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            drop(ranges)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
        drop(ranges)
        read_before, t0 = _read_bytes(), time.perf_counter()
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             stopping_criteria=StoppingCriteriaList([DropAfterEachToken()]))  # fmt: skip
        seconds, read = time.perf_counter() - t0, _read_bytes() - read_before
    new = out[0, len(PROMPT):].tolist()
    return {"tok_s": len(new) / seconds, "read_mb_per_token": read / len(new) / MB, "tokens_sum": float(sum(new))}


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    from transformers import AutoConfig, AutoModelForCausalLM

    form = params["form"]
    extra = {} if form is None else {"offload_quantization": form}
    if extra and getattr(lib, "__name__", "") != "bigmodel":
        raise NotImplementedError("accelerate has no quantized offload storage")
    folder = str(fixtures.CACHE / "smollm2")
    with lib.init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.tie_weights()
    model.eval()
    offload = fixtures.fresh_dir("offload")
    try:
        lib.load_checkpoint_and_dispatch(model, folder, device_map=params["device_map"], offload_folder=offload,
                                         **extra)  # fmt: skip
        folder_mb = sum(p.stat().st_size for p in Path(offload).iterdir()) / MB
        return dict(_cold_generate(model, offloaded_ranges(offload)), folder_mb=folder_mb)
    finally:
        shutil.rmtree(offload, ignore_errors=True)


def floor(params: dict[str, Any]) -> Metrics:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fixtures.CACHE / "smollm2"), dtype=torch.float32).eval()
    return _cold_generate(model, {})


METRICS = (
    Metric("tok_s", "tokens/s, cold page cache (higher is better)", higher_is_better=True, fmt="{:.2f}"),
    Metric("read_mb_per_token", "MB read from storage per token", fmt="{:.1f}"),
    Metric("folder_mb", "offload folder MB", fmt="{:.1f}"),
)
CASES = [
    Case(f"generate_smollm2_half_disk_cold_{label}", f"generate SmolLM2-135M, 15/30 layers on disk as {label}, cold",
         run, floor, METRICS, params={"device_map": "smollm2_half_disk", "form": form}, needs=("smollm2",),
         quick=False)
    for label, form in (("fp32", None), ("float8", "float8"), ("int8", "int8"), ("int4", "int4"))
]
