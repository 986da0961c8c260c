"""transformers' own ``from_pretrained(device_map=...)`` + a forward, on bigmodel vs on accelerate.

The same call both times: SmolLM2-135M (fp32) with the second half of its decoder layers on
``disk`` (a dict map, so both runs use the same placement), loaded by transformers itself.
bigmodel's run switches :func:`bigmodel.use_bigmodel` on first, so transformers dispatches and
offloads with bigmodel; accelerate's run is the plain library.  Timed: the ``from_pretrained``
call, then one warm-up forward of 1x8 tokens and the best of two forwards of 1x128 tokens.
Floor: the same load and forwards with the whole model in memory (no device map, no hooks).
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import torch

from .. import fixtures
from ._llama import input_ids
from .base import Case, Metric, Metrics


def _load_and_forward(device_map: dict[str, str] | None) -> Metrics:
    from transformers import AutoModelForCausalLM

    folder = str(fixtures.CACHE / "smollm2")
    offload = fixtures.fresh_dir("offload")
    try:
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, device_map=device_map, offload_folder=offload if device_map else None
        ).eval()
        load_s = time.perf_counter() - t0
        ids = input_ids(model.config.vocab_size)
        with torch.no_grad():
            model(ids[:, :8])  # warm-up
            forward_s = float("inf")
            for _ in range(2):  # the faster of two: the least disturbed by other work on the machine
                t0 = time.perf_counter()
                logits = model(ids).logits
                forward_s = min(forward_s, time.perf_counter() - t0)
        return {"load_s": load_s, "forward_s": forward_s, "logits_sum": float(logits.double().sum())}
    finally:
        shutil.rmtree(offload, ignore_errors=True)


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    use_bigmodel = getattr(lib, "use_bigmodel", None)  # bigmodel only: accelerate runs as installed
    if use_bigmodel is None:
        return _load_and_forward(params["device_map"])
    with use_bigmodel():
        return _load_and_forward(params["device_map"])


def floor(params: dict[str, Any]) -> Metrics:
    return _load_and_forward(None)


CASES = [
    Case("hf_from_pretrained_smollm2_half_disk",
         "transformers from_pretrained(device_map) + forward 1x128, SmolLM2-135M, 15/30 layers on disk",
         run, floor,
         (Metric("load_s", "from_pretrained time (s)"), Metric("forward_s", "time per forward (s)")),
         params={"device_map": "smollm2_half_disk"}, needs=("smollm2",), warm_files="smollm2"),
]  # fmt: skip
