"""Buffers a device map leaves out: non-persistent buffers go to the main device.

A hand-written device map may omit a module whose only tensors are non-persistent buffers (a
rotary embedding's ``inv_freq``): they are not in the state dict, so the map's check passes them.
No hook moves them, so :func:`place_uncovered_buffers` puts them where the forwards run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from torch import nn

from ..core.devices import DeviceSpec, torch_device
from ..planning.device_map import uncovered_buffers

logger = logging.getLogger(__name__)


def place_uncovered_buffers(model: nn.Module, device_map: Mapping[str, object], main: DeviceSpec) -> list[str]:
    """Move every buffer of ``model`` that ``device_map`` does not cover to ``main`` (values kept).

    Buffers on ``meta`` stay (they have no value to move).

    Args:
        model: the model being dispatched.
        device_map: its device map (already checked).
        main: the main execution device.

    Returns:
        The dotted names of the buffers moved.
    """
    target = torch_device(main)
    moved = []
    for name in uncovered_buffers(model, device_map):
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = getattr(owner, attr)
        if value is None or value.device.type == "meta" or value.device == target:
            continue
        setattr(owner, attr, value.to(target))  # still a buffer (nn.Module routes the assignment)
        moved.append(name)
    if moved:
        logger.info("Buffers the device map leaves out, put on the main device %s: %s", target, ", ".join(moved))
    return moved

