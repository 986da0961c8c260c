"""Compatibility path `accelerate.utils.offload` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "offload_weight",
    "load_offloaded_weight",
    "offload_state_dict",
    "save_offload_index",
    "extract_submodules_state_dict",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
]

__getattr__ = lazy_getattr(__name__, __all__)
