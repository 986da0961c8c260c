"""Compatibility path `accelerate.hooks` (re-exports only)."""

from __future__ import annotations

from typing import Any

from bigmodel._exports import resolve

__all__ = [
    "ModelHook",
    "SequentialHook",
    "add_hook_to_module",
    "remove_hook_from_module",
    "remove_hook_from_submodules",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "LayerwiseCastingHook",
    "attach_execution_device_hook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_layerwise_casting_hooks",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return resolve(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
