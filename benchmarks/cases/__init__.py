"""The benchmark cases, in the order the runner measures and prints them."""

from __future__ import annotations

from . import dispatch, generate, init_empty, loading, planning, quantized_offload
from .base import Case, Metric

CASES: dict[str, Case] = {
    case.name: case
    for module in (init_empty, planning, loading, dispatch, generate, quantized_offload)
    for case in module.CASES
}

__all__ = ["CASES", "Case", "Metric"]
