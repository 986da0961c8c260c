"""Where each public name lives.  ``bigmodel`` and the compatibility modules resolve names lazily from here."""

from __future__ import annotations

import importlib
from typing import Any

EXPORTS: dict[str, str] = {
    # creating models without memory
    "init_empty_weights": "_meta",
    "init_on_device": "_meta",
    # sizes and budgets
    "convert_file_size_to_int": "_sizes",
    "dtype_byte_size": "_sizes",
    "compute_module_sizes": "_sizes",
    "compute_module_total_buffer_size": "_sizes",
    "get_max_layer_size": "_sizes",
    "calculate_maximum_sizes": "_sizes",
    "get_max_memory": "_memory",
    "get_balanced_memory": "_memory",
    # tensors and ties
    "named_module_tensors": "_tensors",
    "get_non_persistent_buffers": "_tensors",
    "set_module_tensor_to_device": "_tensors",
    "find_tied_parameters": "_tensors",
    "retie_parameters": "_tensors",
    "check_tied_parameters_on_same_device": "_tensors",
    "get_module_size_with_ties": "_tensors",
    # device maps
    "infer_auto_device_map": "_planning",
    "check_device_map": "_planning",
    "clean_device_map": "_planning",
    # loading
    "load_state_dict": "_checkpoint",
    "load_checkpoint_in_model": "_loading",
    "get_state_dict_offloaded_model": "_dispatch",
    # offload storage
    "offload_weight": "_offload",
    "load_offloaded_weight": "_offload",
    "offload_state_dict": "_offload",
    "extract_submodules_state_dict": "_offload",
    "OffloadedWeightsLoader": "_offload",
    "PrefixedDataset": "_offload",
    # hooks
    "ModelHook": "_hook_registry",
    "SequentialHook": "_hook_registry",
    "add_hook_to_module": "_hook_registry",
    "remove_hook_from_module": "_hook_registry",
    "remove_hook_from_submodules": "_hook_registry",
    "AlignDevicesHook": "_align",
    "CpuOffload": "_align",
    "UserCpuOffloadHook": "_align",
    "LayerwiseCastingHook": "_casting",
    "attach_execution_device_hook": "_align",
    "attach_align_device_hook": "_align",
    "attach_align_device_hook_on_blocks": "_align",
    "attach_layerwise_casting_hooks": "_casting",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING": "_casting",
    "has_offloaded_params": "_align",
    "align_module_device": "_align",
    "extract_model_from_parallel": "_other",
    # dispatch and offload
    "dispatch_model": "_dispatch",
    "cpu_offload": "_dispatch",
    "cpu_offload_with_hook": "_dispatch",
    "disk_offload": "_dispatch",
    "load_checkpoint_and_dispatch": "_dispatch",
    # bigmodel's own additions
    "load_pretrained": "_hf",
}


def resolve(name: str) -> Any:
    """Import and return the public object ``name``.

    Raises:
        AttributeError: if ``name`` is not a public bigmodel name.
    """
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bigmodel' has no attribute {name!r}")
    return getattr(importlib.import_module(f"bigmodel.{module}"), name)


def lazy_getattr(module_name: str, names: list[str]) -> Any:
    """A module-level ``__getattr__`` for a compatibility module that re-exports ``names`` lazily."""
    allowed = frozenset(names)

    def __getattr__(name: str) -> Any:
        if name in allowed:
            return resolve(name)
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    return __getattr__
