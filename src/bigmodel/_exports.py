"""Where each public name lives.  ``bigmodel`` and the compatibility modules resolve names lazily from here."""

from __future__ import annotations

import importlib
from typing import Any

EXPORTS: dict[str, str] = {
    # creating models without memory
    "init_empty_weights": "core.meta",
    "init_on_device": "core.meta",
    # sizes and budgets
    "convert_file_size_to_int": "core.sizes",
    "dtype_byte_size": "core.sizes",
    "compute_module_sizes": "core.sizes",
    "compute_module_total_buffer_size": "core.sizes",
    "get_max_layer_size": "core.sizes",
    "calculate_maximum_sizes": "core.sizes",
    "CustomDtype": "core.sizes",
    "get_max_memory": "planning.memory",
    "get_balanced_memory": "planning.memory",
    "clear_device_cache": "core.devices",
    # tensors and ties
    "named_module_tensors": "core.tensors",
    "get_non_persistent_buffers": "core.tensors",
    "set_module_tensor_to_device": "core.tensors",
    "find_tied_parameters": "core.tensors",
    "retie_parameters": "core.tensors",
    "check_tied_parameters_on_same_device": "core.tensors",
    "get_module_size_with_ties": "core.tensors",
    # device maps
    "infer_auto_device_map": "planning.device_map",
    "check_device_map": "planning.device_map",
    "clean_device_map": "planning.device_map",
    # loading
    "load_state_dict": "checkpoints.files",
    "load_checkpoint_in_model": "loading.loader",
    "get_state_dict_offloaded_model": "dispatch.dispatch",
    # offload storage
    "offload_weight": "offload.storage",
    "load_offloaded_weight": "offload.storage",
    "offload_state_dict": "offload.storage",
    "extract_submodules_state_dict": "offload.storage",
    "OffloadedWeightsLoader": "offload.storage",
    "PrefixedDataset": "offload.storage",
    "save_offload_index": "offload.storage",
    "load_offloaded_weights": "offload.storage",
    # hooks
    "ModelHook": "hooks.registry",
    "SequentialHook": "hooks.registry",
    "add_hook_to_module": "hooks.registry",
    "remove_hook_from_module": "hooks.registry",
    "remove_hook_from_submodules": "hooks.registry",
    "AlignDevicesHook": "hooks.align",
    "CpuOffload": "hooks.cpu_offload",
    "UserCpuOffloadHook": "hooks.cpu_offload",
    "LayerwiseCastingHook": "hooks.casting",
    "attach_execution_device_hook": "hooks.align",
    "attach_align_device_hook": "hooks.align",
    "attach_align_device_hook_on_blocks": "hooks.align",
    "attach_layerwise_casting_hooks": "hooks.casting",
    "SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING": "hooks.casting",
    "has_offloaded_params": "hooks.align",
    "align_module_device": "hooks.align",
    "extract_model_from_parallel": "core.wrappers",
    "send_to_device": "hooks.moving",
    # dispatch and offload
    "dispatch_model": "dispatch.dispatch",
    "cpu_offload": "dispatch.dispatch",
    "cpu_offload_with_hook": "dispatch.dispatch",
    "disk_offload": "dispatch.dispatch",
    "load_checkpoint_and_dispatch": "dispatch.dispatch",
    # bigmodel's own additions
    "load_pretrained": "integrations.hf",
    "use_bigmodel": "integrations.ecosystem",
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
