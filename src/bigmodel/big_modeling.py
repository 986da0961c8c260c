"""Compatibility path `accelerate.big_modeling` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr

__all__ = [
    "init_empty_weights",
    "init_on_device",
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "load_checkpoint_and_dispatch",
    "attach_layerwise_casting_hooks",
    "infer_auto_device_map",
    "get_balanced_memory",
    "get_max_memory",
    "check_device_map",
    "load_checkpoint_in_model",
    "find_tied_parameters",
    "retie_parameters",
    "offload_state_dict",
    "extract_submodules_state_dict",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "has_offloaded_params",
    "add_hook_to_module",
    "remove_hook_from_submodules",
    "AlignDevicesHook",
    "CpuOffload",
    "UserCpuOffloadHook",
    "LayerwiseCastingHook",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING",
]

__getattr__ = lazy_getattr(__name__, __all__)
