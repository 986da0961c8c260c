"""Compatibility path `accelerate.utils.constants` (re-exports only)."""

from __future__ import annotations

from typing import Any

from bigmodel._exports import resolve

__all__ = [
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
