"""Compatibility path `accelerate.utils.modeling` (re-exports only)."""

from __future__ import annotations

from bigmodel._exports import lazy_getattr
from bigmodel.utils import offload

__all__ = [
    "convert_file_size_to_int",
    "dtype_byte_size",
    "compute_module_sizes",
    "compute_module_total_buffer_size",
    "get_max_layer_size",
    "calculate_maximum_sizes",
    "get_max_memory",
    "get_balanced_memory",
    "named_module_tensors",
    "get_non_persistent_buffers",
    "set_module_tensor_to_device",
    "find_tied_parameters",
    "retie_parameters",
    "check_tied_parameters_on_same_device",
    "get_module_size_with_ties",
    "infer_auto_device_map",
    "check_device_map",
    "clean_device_map",
    "load_state_dict",
    "load_checkpoint_in_model",
    "get_state_dict_offloaded_model",
    "load_offloaded_weights",
    "has_offloaded_params",
    "align_module_device",
    *offload.__all__,  # accelerate.utils.modeling imports these from its offload module
]

__getattr__ = lazy_getattr(__name__, __all__)
