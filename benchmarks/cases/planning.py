"""``infer_auto_device_map`` on meta models: Llama-3.1-405B and a 94-layer x 128-expert MoE.

Budgets: 4 accelerators + cpu + disk (``fixtures.planning_budgets``), scaled with the
layer count so the map always spans every device.  Floor: one pass over every module
summing its direct parameter bytes, the least any planner must read.
"""

from __future__ import annotations

from typing import Any

from .. import fixtures
from ..measure import probe
from .base import Case, Metric, Metrics


def run(lib: Any, params: dict[str, Any]) -> Metrics:
    model, no_split = fixtures.meta_model(params["kind"], params["scale"])
    budgets = fixtures.planning_budgets(params["kind"], params["scale"])
    infer = lib.infer_auto_device_map
    with probe() as p:
        device_map = infer(model, max_memory=dict(budgets), no_split_module_classes=no_split)
    devices = {str(d) for d in device_map.values()}
    if "disk" not in devices or "0" not in devices:
        raise RuntimeError(f"map does not span the budgets: devices used {sorted(devices)}")
    return {"time_s": p.seconds, "entries": float(len(device_map))}


def floor(params: dict[str, Any]) -> Metrics:
    model, _ = fixtures.meta_model(params["kind"], params["scale"])
    with probe() as p:
        sizes = {}
        for name, module in model.named_modules():
            sizes[name] = sum(t.numel() * t.element_size() for t in module._parameters.values() if t is not None)
    return {"time_s": p.seconds}


def _case(kind: str, scale: int, label: str) -> Case:
    return Case(f"plan_{kind}_{scale}x", f"infer_auto_device_map, {label} x{scale} layers", run, floor,
                (Metric("time_s", "time (s)", fmt="{:.4f}"),),
                params={"kind": kind, "scale": scale}, quick=scale == 1, timeout_s=240)


CASES = [_case("llama405b", s, "Llama-3.1-405B") for s in (1, 2, 4)] + [
    _case("moe", s, "MoE 94L x 128 experts") for s in (1, 2, 4)
]
