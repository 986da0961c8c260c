"""Compatibility path `accelerate.utils.other` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "extract_model_from_parallel",
]

__getattr__ = lazy_getattr(__name__, __all__)
