"""Compatibility path `accelerate.utils.operations` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "send_to_device",
]

__getattr__ = lazy_getattr(__name__, __all__)
