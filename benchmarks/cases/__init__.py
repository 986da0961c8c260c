"""The benchmark cases, in the order the runner measures and prints them."""

from __future__ import annotations

from . import cold, dispatch, ecosystem, generate, hook_overhead, init_empty, loading, planning, quantized_offload
from .base import Case, Metric

CASES: dict[str, Case] = {
    case.name: case
    for module in (init_empty, planning, loading, dispatch, cold, generate, hook_overhead, quantized_offload, ecosystem)
    for case in module.CASES
}

__all__ = ["CASES", "Case", "Metric"]
