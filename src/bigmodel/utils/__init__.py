"""Compatibility path `accelerate.utils` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr
from bigmodel.utils import (
    constants,
    dataclasses,
    memory,
    modeling,
    offload,
    operations,
    other,
)

__all__ = list(
    dict.fromkeys(
        [*modeling.__all__, *offload.__all__, *constants.__all__, *other.__all__, *memory.__all__,
         *operations.__all__, *dataclasses.__all__]
    )
)  # fmt: skip

__getattr__ = lazy_getattr(__name__, __all__)
