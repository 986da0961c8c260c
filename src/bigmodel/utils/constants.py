"""Compatibility path `accelerate.utils.constants` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
]

__getattr__ = lazy_getattr(__name__, __all__)
