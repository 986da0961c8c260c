"""Compatibility path `accelerate.utils.dataclasses` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "CustomDtype",
]

__getattr__ = lazy_getattr(__name__, __all__)
