"""Compatibility path `accelerate.utils.other` (re-exports only)."""

from __future__ import annotations

from typing import Any

from bigmodel._exports import resolve

__all__ = [
    "extract_model_from_parallel",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
