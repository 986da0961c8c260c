"""Loading a checkpoint whose keys are not the model's names (see :mod:`bigmodel.loading.conversion`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..core.devices import DeviceSpec
from ..core.sizes import floating_dtype
from ..offload.quantized import check_form
from .conversion import KeyConversion
from .loader import _load

__all__ = ["load_converted_checkpoint"]


def load_converted_checkpoint(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    conversion: KeyConversion,
    *,
    device_map: Mapping[str, DeviceSpec] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Sequence[str] | None = None,
    strict: bool = False,
    offload_quantization: str | None = None,
) -> None:
    """:func:`load_checkpoint_in_model` for a checkpoint whose keys are not the model's names.

    Renamed tensors load as any other (zero-copy views, pointers into safetensors files for
    disk); tensors built by a recipe are built once their sources are read and then placed
    like the others (written to ``.dat`` files when they go to disk).

    Args:
        model: the model, usually built under :func:`bigmodel.init_empty_weights`.
        checkpoint: a weights file, a sharded checkpoint's ``*.index.json``, or a folder holding one.
        conversion: checkpoint key → model name, and the recipes that build fused tensors.
        device_map, offload_folder, dtype, offload_state_dict, offload_buffers, keep_in_fp32_modules,
            strict, offload_quantization: as in :func:`load_checkpoint_in_model`; key checks use the
            model's names.

    Raises:
        FileNotFoundError: the checkpoint or one of its shards is missing.
        ValueError: as in :func:`load_checkpoint_in_model`, and a recipe that fails on the
            checkpoint's shapes (names its sources); raised before the model is modified.
        PermissionError: the offload folder is not writable.
    """
    _load(
        model, checkpoint, conversion, device_map, offload_folder, floating_dtype(dtype), offload_state_dict,
        offload_buffers, keep_in_fp32_modules or (), strict, check_form(offload_quantization),
    )  # fmt: skip
