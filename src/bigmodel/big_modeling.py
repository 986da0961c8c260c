"""Compatibility path `accelerate.big_modeling` (re-exports only)."""

from __future__ import annotations

from typing import Any

from bigmodel._exports import resolve

__all__ = [
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
