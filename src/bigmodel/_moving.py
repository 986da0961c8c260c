"""Move nested inputs and outputs to a device: tensors inside tuples, lists, dicts,
namedtuples, dataclasses and ``ModelOutput``-like mappings.  Containers keep their type."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn


_NO_SKIP: frozenset[str] = frozenset()


def _skip_set(skip_keys: str | Iterable[str] | None) -> frozenset[str]:
    if skip_keys is None:
        return _NO_SKIP
    if isinstance(skip_keys, str):
        return frozenset((skip_keys,))
    return frozenset(skip_keys)


def send_to_device(
    obj: Any, device: Any, non_blocking: bool = False, skip_keys: str | Iterable[str] | None = None
) -> Any:
    """Return ``obj`` with every tensor inside moved to ``device``.

    Args:
        obj: a tensor, or a (nested) tuple, list, namedtuple, dict/Mapping, dataclass, or an
            object with a ``.to`` method (``BatchEncoding``).  Anything else comes back as is.
        device: a torch device or device spec (``0``, ``"cpu"``).  None returns ``obj`` unchanged.
        non_blocking: asynchronous host↔device copies.
        skip_keys: mapping keys (at any depth) whose values are left where they are.

    Returns:
        The same structure (same container types) with tensors on ``device``; tensors already
        there are returned as the same objects.
    """
    if device is None:
        return obj
    return _move(obj, device, non_blocking, _skip_set(skip_keys))


def _move(obj: Any, device: Any, non_blocking: bool, skip: frozenset[str]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device == device or obj.device.type == "meta":  # already there: no .to() call
            return obj
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_move(x, device, non_blocking, skip) for x in obj))
    if isinstance(obj, (tuple, list)):
        if not obj:
            return obj if isinstance(obj, tuple) else type(obj)()
        return type(obj)(_move(x, device, non_blocking, skip) for x in obj)
    if isinstance(obj, Mapping):
        if not obj and type(obj) is dict:
            return {}
        return _move_mapping(obj, device, non_blocking, skip)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {
            f.name: _move(getattr(obj, f.name), device, non_blocking, skip)
            for f in dataclasses.fields(obj)
            if f.init and f.name not in skip
        }
        return dataclasses.replace(obj, **changes)
    to = getattr(obj, "to", None)
    if callable(to) and not isinstance(obj, nn.Module):
        try:
            return to(device)
        except (TypeError, RuntimeError):
            return obj
    return obj


def _move_mapping(obj: Mapping, device: Any, non_blocking: bool, skip: frozenset[str]) -> Any:
    moved = {k: (v if k in skip else _move(v, device, non_blocking, skip)) for k, v in obj.items()}
    if type(obj) is dict:
        return moved
    if dataclasses.is_dataclass(obj):  # ModelOutput: an ordered dict and a dataclass
        try:
            return type(obj)(**moved)
        except TypeError:
            pass
    try:
        return type(obj)(moved)
    except Exception:
        return moved


def find_device(obj: Any) -> torch.device | None:
    """The device of the first tensor found in ``obj`` (same traversal as :func:`send_to_device`), or None."""
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, Mapping):
        obj = obj.values()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list, type({}.values()))):
        for item in obj:
            device = find_device(item)
            if device is not None:
                return device
    return None
