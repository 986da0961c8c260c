"""Compatibility path `accelerate.utils.memory` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "clear_device_cache",
]

__getattr__ = lazy_getattr(__name__, __all__)
