"""Checks of a checkpoint's tensors against a model: before anything is loaded, and after (nothing left on meta)."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from ..checkpoints.files import TensorInfo
from ..core.coverage import device_of, is_covered
from ..core.devices import (
    DeviceSpec,
    lacking_device,
    normalize_device,
    torch_device,
)
from ..offload.format import load_offload_index

logger = logging.getLogger(__name__)

_MAX_LISTED_KEYS = 20


class CheckpointMismatchError(ValueError, RuntimeError):
    """``strict=True`` found keys the model and the checkpoint do not share.

    A ValueError naming the keys, and a RuntimeError as torch's ``load_state_dict(strict=True)``
    (which accelerate uses for a load without a device map) raises it.
    """


# model → offload folder (real path, None for none) → names of the model's tensors loads have filled there.
_FILLED: weakref.WeakKeyDictionary[nn.Module, dict[str | None, set[str]]] = weakref.WeakKeyDictionary()


def note_filled(model: nn.Module, offload_folder: str | os.PathLike | None, names: Iterable[str]) -> set[str]:
    """Record ``names`` as filled by a load of ``model`` with ``offload_folder``.

    Returns:
        Every name loads of this model object with this folder filled so far (an earlier load of
        another checkpoint into the same model and folder included; another model's offload is not).
    """
    key = os.path.realpath(offload_folder) if offload_folder is not None else None
    seen = _FILLED.setdefault(model, {}).setdefault(key, set())
    seen.update(names)
    return set(seen)


def report_keys(missing: list[str], unexpected: list[str], strict: bool) -> None:
    """Log the keys the model and the checkpoint do not share, or raise with ``strict``.

    Raises:
        CheckpointMismatchError: with ``strict``, when any key is missing or unexpected (lists
            them); both a ValueError and a RuntimeError.
    """
    if not missing and not unexpected:
        return
    labelled = (("missing", missing), ("unexpected", unexpected))
    parts = [f"{label} keys ({len(keys)}): {listed(keys)}" for label, keys in labelled if keys]
    if strict:
        raise CheckpointMismatchError(
            "The checkpoint does not match the model; " + "; ".join(parts)
            + ". Load the matching checkpoint, or pass strict=False to load what matches."
        )
    for part in parts:
        logger.warning("Loading checkpoint: %s", part)


def listed(keys: list[str]) -> str:
    """The first keys of a list, joined for an error message, with how many more there are."""
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    return shown + (f" ... and {len(keys) - _MAX_LISTED_KEYS} more" if len(keys) > _MAX_LISTED_KEYS else "")


def check_shapes(
    expected: Mapping[str, torch.Tensor], infos: Mapping[str, TensorInfo], aliases: Mapping[str, list[str]]
) -> None:
    """Compare the shape of every model tensor the checkpoint fills (tied names included).

    Raises:
        ValueError: a shape differs (names each tensor and both shapes).
    """
    pairs = [(n, n) for n in infos if n in expected] + [(a, k) for k, names in aliases.items() for a in names]
    bad = [
        f"{name!r}: checkpoint {list(infos[key].shape)} vs model {list(expected[name].shape)}"
        for name, key in sorted(pairs)
        if tuple(expected[name].shape) != infos[key].shape
    ]
    if bad:
        raise ValueError(
            f"Shape mismatch between the checkpoint and the model for {len(bad)} tensor(s): {listed(bad)}. "
            "Build the model from the checkpoint's config."
        )


def placeable_device(name: str, device: DeviceSpec) -> torch.device:
    """The torch device a device map gives tensor ``name``, checked to exist on this machine.

    Raises:
        ValueError: the spec is not a device, or names an accelerator type or index this
            machine does not have (names the tensor, the device and the fix), so that a bad
            map fails before any tensor is placed rather than halfway through the load.
    """
    try:
        normalize_device(device)
        target = torch_device(device)
    except ValueError as err:
        raise ValueError(f"The device map puts {name!r} on {device!r}: {err}") from err
    have = lacking_device(target)
    if have is not None:
        raise ValueError(
            f"The device map puts {name!r} on {device!r}, but this machine has {have}; map it to an existing "
            "device, 'cpu' or 'disk'."
        )
    return target


def check_filled(
    model: nn.Module, checkpoint: str | os.PathLike, device_map: Mapping[str, DeviceSpec] | None,
    offload_folder: str | os.PathLike | None, filled: set[str] | None = None,
) -> None:  # fmt: skip
    """Raise if the model still has tensors on ``meta`` that a load left without a value.

    Tensors mapped to ``"disk"`` are on ``meta`` by design; they count as filled when the offload
    folder's index holds them and, when ``filled`` is given (:func:`note_filled`: the names loads of
    this model filled), a load of this model wrote that entry: an entry another model's offload left
    there is no value of this checkpoint.  Tensors mapped to ``"meta"`` itself are left alone.

    Raises:
        ValueError: names the tensors the checkpoint did not provide, and the fixes.
    """
    offloaded = set(load_offload_index(offload_folder)) if offload_folder is not None else set()
    if filled is not None:
        offloaded &= filled
    on_meta = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.device.type == "meta"]
    unfilled = [name for name in on_meta if _unfilled(_mapped_to(name, device_map), name in offloaded)]
    if unfilled:
        raise ValueError(
            f"{len(unfilled)} tensor(s) of {type(model).__name__} are still on the meta device after loading "
            f"{str(checkpoint)!r}, which did not provide them: {listed(unfilled)}. Fix the checkpoint (it may be "
            "for another model, or nest its state dict under a key), or give them values before dispatching "
            "(initialise them, or tie them with model.tie_weights() if they are tied weights)."
        )
    empty = meta_non_persistent(model, device_map)
    if empty:
        raise ValueError(
            f"{len(empty)} non-persistent buffer(s) of {type(model).__name__} are on the meta device: "
            f"{listed(empty)}. {NON_PERSISTENT_FIX}"
        )


NON_PERSISTENT_FIX = (
    "Non-persistent buffers (register_buffer(..., persistent=False), e.g. a rotary embedding's inv_freq) are "
    "never saved in a checkpoint, so no load fills them: build the model under init_empty_weights() without "
    "include_buffers=True (buffers then keep their values), or set them before dispatching."
)


def meta_non_persistent(model: nn.Module, device_map: Mapping[str, DeviceSpec] | None = None) -> list[str]:
    """Dotted names of the non-persistent buffers of ``model`` that are on ``meta`` (no load fills them),
    but those ``device_map`` (when given) maps to ``"meta"`` itself."""
    names = []
    for prefix, module in model.named_modules():
        for name in sorted(module._non_persistent_buffers_set):
            buffer, full = module._buffers.get(name), f"{prefix}.{name}" if prefix else name
            if buffer is not None and buffer.device.type == "meta" and not is_meta_device(_mapped_to(full, device_map)):
                names.append(full)
    return names


def warn_meta_non_persistent(model: nn.Module) -> None:
    """Log a warning naming the non-persistent buffers a load leaves on ``meta``, and the fix."""
    empty = meta_non_persistent(model)
    if empty:
        logger.warning("Loading checkpoint: %d non-persistent buffer(s) stay on the meta device: %s. %s",
                       len(empty), listed(empty), NON_PERSISTENT_FIX)  # fmt: skip


def _mapped_to(name: str, device_map: Mapping[str, DeviceSpec] | None) -> object:
    """The device the map gives ``name`` as given (None when there is no map or it is not covered)."""
    return device_of(name, device_map) if device_map is not None and is_covered(name, device_map) else None


def _unfilled(mapped: object, in_index: bool) -> bool:
    """A tensor on ``meta`` lacks a value unless mapped to ``"meta"`` or on disk with an index entry."""
    return not is_meta_device(mapped) and not (mapped == "disk" and in_index)


def is_meta_device(mapped: object) -> bool:
    """True for a device map value naming ``meta``: ``"meta"``, ``"META"``, ``torch.device("meta")``."""
    try:
        return mapped is not None and normalize_device(mapped) == "meta"
    except ValueError:
        return False
