"""Compatibility path `accelerate.utils.offload` (re-exports only)."""

from __future__ import annotations

from typing import Any

from bigmodel._exports import resolve

__all__ = [
    "offload_weight",
    "load_offloaded_weight",
    "offload_state_dict",
    "extract_submodules_state_dict",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
