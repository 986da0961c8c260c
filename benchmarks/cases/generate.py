"""Generate with SmolLM2-135M (the embedded model): half the decoder layers on disk vs all in memory.

Greedy ``model.generate`` of exactly 16 new tokens after an 8-token prompt, after a
2-token warm-up generate, twice; tokens/s of the faster one (higher is better).
Floor: the same generate with the whole model in memory and no hooks.
"""

from __future__ import annotations

import shutil
import time
from typing import Any

import torch

from .. import fixtures
from .base import Case, Metric, Metrics

NEW_TOKENS = 16
PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 2]


def _generate(model) -> Metrics:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, do_sample=False)
        seconds = float("inf")
        for _ in range(2):  # the faster of two: the least disturbed by other work on the machine
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            seconds = min(seconds, time.perf_counter() - t0)
    new = out[0, len(PROMPT):].tolist()
    return {"tok_s": len(new) / seconds, "tokens_sum": float(sum(new))}


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = str(fixtures.CACHE / "smollm2")
    with lib.init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.tie_weights()  # lm_head shares the embedding (the checkpoint stores it once)
    model.eval()
    offload = fixtures.fresh_dir("offload")
    try:
        lib.load_checkpoint_and_dispatch(model, folder, device_map=params["device_map"], offload_folder=offload)
        return _generate(model)
    finally:
        shutil.rmtree(offload, ignore_errors=True)


def floor(params: dict[str, Any]) -> Metrics:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(fixtures.CACHE / "smollm2"), dtype=torch.float32).eval()
    return _generate(model)


CASES = [
    Case("generate_smollm2_half_disk", "generate SmolLM2-135M, 15/30 layers on disk", run, floor,
         (Metric("tok_s", "tokens/s (higher is better)", higher_is_better=True, fmt="{:.2f}"),),
         params={"device_map": "smollm2_half_disk"}, needs=("smollm2",), warm_files="smollm2"),
]
