"""``load_checkpoint_and_dispatch``: the one-call path, plan → load → check → dispatch.

A call that fails leaves the offload folder as it found it (:class:`~bigmodel.offload.undo.OffloadFolderUndo`);
no other offload writes the folder while a call runs (:func:`~bigmodel.offload.folder_lock.folder_lock`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from ..core.devices import DeviceSpec
from ..offload.folder_lock import folder_lock
from ..offload.undo import OffloadFolderUndo
from ..planning.disjoint import check_map_type


def load_checkpoint_and_dispatch(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: str | Mapping[str, DeviceSpec] | None = None,
    max_memory: Mapping[DeviceSpec, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    offload_folder: str | os.PathLike | None = None,
    offload_buffers: bool = False,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool | None = None,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    offload_quantization: str | None = None,
) -> nn.Module:
    """Plan a device map (if a string), load ``checkpoint`` into ``model`` along it, and dispatch.

    Args:
        model: the model, usually built under :func:`bigmodel.init_empty_weights`.
        checkpoint: a weights file, a ``*.index.json`` or a folder holding one.
        device_map: a dict, or ``"auto"``/``"balanced"``/``"balanced_low_0"``/``"sequential"``;
            None loads without dispatching.
        max_memory: device → budget (bytes or ``"10GiB"``) for string maps.
        no_split_module_classes: classes never split (default: ``model._no_split_modules``).
        offload_folder: folder for ``"disk"`` parts.
        offload_buffers, dtype, offload_state_dict, strict, full_state_dict, broadcast_from_rank0:
            as in :func:`bigmodel.load_checkpoint_in_model`.
        skip_keys, preload_module_classes, force_hooks, offload_quantization: as in :func:`dispatch_model`
            (the disk part is quantized while it is loaded, see :func:`bigmodel.load_checkpoint_in_model`).

    Returns:
        The model, loaded and dispatched.

    A key of the map inside another (``{"": "disk", "0": "cpu"}``) wins for the tensors it covers:
    each tensor goes to the device of its longest matching key.

    Raises:
        TypeError: ``device_map`` or ``max_memory`` of the wrong type (names what was given).
        ValueError: an unknown string map (lists the accepted ones), disk parts without
            ``offload_folder``, or tensors still on ``meta`` after the load with a ``device_map`` (the
            checkpoint lacks them: names them; raised before dispatching; without a map the model is
            returned as loaded, missing keys logged, as the incumbent does).  After an error, what this call wrote
            into ``offload_folder`` is removed again (what was there before is kept).
    """
    from ..dispatch.dispatch import dispatch_model
    from ..loading.key_checks import check_filled
    from ..loading.loader import load_filling
    from ..planning.device_map import resolve_device_map

    if device_map is not None:
        check_map_type(device_map, allow_strings=True)
    if no_split_module_classes is None:
        no_split_module_classes = list(getattr(model, "_no_split_modules", None) or []) or None
    if isinstance(device_map, str):
        device_map = resolve_device_map(
            model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers=offload_buffers
        )
    if offload_state_dict is None:
        offload_state_dict = device_map is not None and "disk" in device_map.values()
    # Locked first: the undo's snapshot and the dispatch's mapping see no other process's offload.  Not
    # when broadcasting from rank 0 (it writes no folder; ranks of one machine sharing the folder's name
    # would wait for the lock while the holder waits for them in a collective).
    with folder_lock(None if broadcast_from_rank0 else offload_folder), OffloadFolderUndo(offload_folder):
        filled = load_filling(
            model, checkpoint, device_map, offload_folder, dtype, offload_state_dict, offload_buffers, None, False,
            strict, full_state_dict, broadcast_from_rank0, offload_quantization,
        )  # fmt: skip
        if device_map is None:
            return model  # loaded only, as the incumbent does: missing keys were logged, none is checked
        check_filled(model, checkpoint, device_map, offload_folder, filled)
        return dispatch_model(
            model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
            skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks,
            offload_quantization=offload_quantization,
        )  # fmt: skip


