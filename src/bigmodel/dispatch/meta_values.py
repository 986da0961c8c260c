"""Tensors without values: a dispatch that would move ``meta`` tensors to a device is refused, naming them.

A model built under ``init_empty_weights`` holds ``meta`` tensors until a checkpoint fills them.
Moving one to a device has nothing to copy (torch: "Cannot copy out of meta tensor; no data!");
``dispatch_model`` with a one-device map moves the whole model, so it says instead which tensors
never got a value and how to give them one.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain

from torch import nn

from ..core.devices import DeviceSpec, torch_device
from ..loading.key_checks import NON_PERSISTENT_FIX, listed, meta_non_persistent

__all__ = ["MetaTensorError", "refuse_meta_non_persistent", "refuse_meta_tensors"]


class MetaTensorError(NotImplementedError, ValueError):
    """Tensors on ``meta`` (no values) that would be moved to a device (their names are in the message).

    A :class:`NotImplementedError`, what torch raises for such a move (code written for accelerate, which
    lets torch raise it, catches that), and a :class:`ValueError`, as bigmodel's other errors about
    tensors a load left without a value.
    """


def refuse_meta_tensors(model: nn.Module, device: DeviceSpec) -> None:
    """Raise if moving ``model`` to ``device`` would meet tensors on ``meta``.

    Args:
        model: the model about to be moved (its hooks already removed).
        device: where it goes; ``"meta"`` itself needs no values.

    Raises:
        MetaTensorError: names the parameters and buffers on ``meta`` and the fixes (nothing is moved).
    """
    if torch_device(device).type == "meta":
        return
    tensors = chain(model.named_parameters(), model.named_buffers())
    on_meta = [name for name, tensor in tensors if tensor.device.type == "meta"]
    # Only buffers no checkpoint holds (asked only when something is on meta): loading would not help.
    if on_meta and set(meta_non_persistent(model)).issuperset(on_meta):
        raise MetaTensorError(
            f"{len(on_meta)} non-persistent buffer(s) of {type(model).__name__} are on the meta device, so the "
            f"model cannot be moved to {str(device)!r}: {listed(on_meta)}. {NON_PERSISTENT_FIX}"
        )
    if on_meta:
        raise MetaTensorError(
            f"{len(on_meta)} tensor(s) of {type(model).__name__} are on the meta device and hold no value, so the "
            f"model cannot be moved to {str(device)!r}: {listed(on_meta)}. Load the weights first "
            "(load_checkpoint_and_dispatch(model, checkpoint, device_map=...), or load_checkpoint_in_model), or "
            "create them with model.to_empty(device=...) and initialise them."
        )


def refuse_meta_non_persistent(model: nn.Module, device_map: Mapping[str, DeviceSpec]) -> None:
    """Raise if ``model`` holds non-persistent buffers on ``meta`` that ``device_map`` sends to a device.

    No checkpoint holds such buffers (a model built with ``init_empty_weights(include_buffers=True)``
    has them on ``meta`` after any load); a hook moving one fails in the first forward with an error
    that names neither the buffer's module nor the fix.  Buffers mapped to ``"meta"`` are left alone.

    Raises:
        MetaTensorError: names the buffers and the fix (nothing is changed).
    """
    empty = meta_non_persistent(model, device_map)
    if empty:
        raise MetaTensorError(
            f"{len(empty)} non-persistent buffer(s) of {type(model).__name__} are on the meta device and hold no "
            f"value, so the model cannot be dispatched: {listed(empty)}. {NON_PERSISTENT_FIX}"
        )
