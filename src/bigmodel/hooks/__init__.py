"""Hooks: the registry, the device-alignment hook, attaching it along a map, layerwise casting.

This package is also the compatibility path `accelerate.hooks`: its public names are re-exported here.
"""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

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
    "set_module_tensor_to_device",
    "named_module_tensors",
    "get_non_persistent_buffers",
    "send_to_device",
    "find_tied_parameters",
    "PrefixedDataset",
    "extract_submodules_state_dict",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
]

__getattr__ = lazy_getattr(__name__, __all__)
