"""``init_empty_weights`` of a Llama 70B (floor: a bare ``with torch.device("meta")`` build)."""

from __future__ import annotations

from typing import Any

import torch

from .. import fixtures
from ..measure import probe
from .base import Case, Metric, Metrics

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=128)


def _build(context_factory) -> Metrics:
    from transformers import LlamaForCausalLM

    with context_factory():  # warm-up: lazy imports and first-call costs, same for every contender
        LlamaForCausalLM(fixtures.llama_config(_TINY))
    config = fixtures.llama_config(fixtures.LLAMA_70B)
    with probe() as p:
        with context_factory():
            model = LlamaForCausalLM(config)
    not_meta = [n for n, t in model.named_parameters() if t.device.type != "meta"]
    if not_meta:
        raise RuntimeError(f"{len(not_meta)} parameters not on meta, e.g. {not_meta[0]}")
    return {"time_s": p.seconds, "peak_rss_mb": p.peak_rss / 1e6}


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    return _build(lib.init_empty_weights)


def floor(params: dict[str, Any]) -> Metrics:
    return _build(lambda: torch.device("meta"))


CASES = [
    Case("init_empty_70b", "init_empty_weights, Llama 70B", run, floor,
         (Metric("time_s", "time (s)"), Metric("peak_rss_mb", "peak RSS (MB)", fmt="{:.0f}"))),
]
