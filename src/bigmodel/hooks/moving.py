"""Move nested inputs and outputs to a device: tensors inside tuples, lists, dicts,
namedtuples, dataclasses and ``ModelOutput``-like mappings.  Containers keep their type.

Also :func:`own_parameters_moved`: a module's own parameters on a device for a ``with`` block."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..core.devices import torch_device

_NO_SKIP: frozenset[str] = frozenset()


def checked_skip_keys(skip_keys: Any) -> Any:
    """``skip_keys`` as given, once known to be None, a key (str) or an iterable of keys (not consumed).

    Raises:
        TypeError: anything else (an int, ...): names the value and the fix, where the hook is made
            rather than at each forward.
    """
    if skip_keys is not None and not isinstance(skip_keys, (str, Iterable)):
        raise TypeError(
            f"skip_keys={skip_keys!r} ({type(skip_keys).__name__}) is neither a key nor a list of keys; pass the "
            "name of an input/output mapping key never moved (a str), a list of them, or None."
        )
    return skip_keys


def _skip_set(skip_keys: str | Iterable[str] | None) -> frozenset[str]:
    if skip_keys is None:
        return _NO_SKIP
    if isinstance(skip_keys, str):
        return frozenset((skip_keys,))
    return frozenset(checked_skip_keys(skip_keys))


def send_to_device(
    tensor: Any, device: Any, non_blocking: bool = False, skip_keys: str | Iterable[str] | None = None
) -> Any:
    """Return ``tensor`` with every tensor inside moved to ``device``.

    Args:
        tensor: a tensor, or a (nested) tuple, list, namedtuple, dict/Mapping, dataclass, or an
            object with a ``.to`` method (``BatchEncoding``).  Anything else comes back as is.
        device: a torch device or device spec (``0``, ``"cpu"``).  None returns ``tensor`` unchanged.
        non_blocking: asynchronous host↔device copies.
        skip_keys: mapping keys (at any depth) whose values are left where they are.

    Returns:
        The same structure (same container types) with tensors on ``device``; tensors already
        there are returned as the same objects.
    """
    if device is None:
        return tensor
    return _move(tensor, device, non_blocking, _skip_set(skip_keys))


_LEAVES = (str, bytes, int, float, bool, type(None))


def _settled(obj: Any, device: torch.device) -> bool:
    """True if :func:`_move` would give ``obj`` back unchanged: no tensor to move, no ``.to`` to call,
    no container to rebuild (only plain tuples are looked into; any other container says False)."""
    if isinstance(obj, torch.Tensor):
        return obj.device == device or obj.device.type == "meta"
    if isinstance(obj, _LEAVES):
        return True
    if type(obj) is tuple:
        for item in obj:
            if not _settled(item, device):
                return False
        return True
    cls = type(obj)
    if cls in _OPAQUE_TYPES:  # only an instance attribute could make it movable
        state = getattr(obj, "__dict__", None)
        return state is None or "to" not in state
    if isinstance(obj, (tuple, list, Mapping)) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type)):
        return False
    if isinstance(obj, nn.Module):
        return True
    plain_lookup = cls.__getattribute__ is object.__getattribute__ and not hasattr(cls, "__getattr__")
    if plain_lookup and not hasattr(cls, "to") and "to" not in getattr(obj, "__dict__", ()):
        _OPAQUE_TYPES.add(cls)  # e.g. a KV cache object: asked by type from now on (no failed attribute lookup)
        return True
    return not callable(getattr(obj, "to", None))


# Classes that are no container, no dataclass, and have no ``to`` (nor ``__getattr__``/``__getattribute__``): _move gives their
# instances back unchanged unless an instance has a ``to`` of its own.
_OPAQUE_TYPES: set[type] = set()


def send_inputs_to_device(
    args: tuple, kwargs: dict, device: torch.device | None, skip_keys: str | Iterable[str] | None = None
) -> tuple[tuple, dict]:
    """A forward's ``(args, kwargs)`` on ``device``, like :func:`send_to_device` on each.

    When nothing needs moving (the common case of a CPU execution device and CPU inputs), the
    same ``args`` and ``kwargs`` objects come back without rebuilding them.

    Args:
        args: positional inputs (moved without ``skip_keys``).
        kwargs: keyword inputs; values under ``skip_keys`` (at any depth) are left where they are.
        device: a :class:`torch.device`; None returns the inputs unchanged.
        skip_keys: mapping keys never moved.

    Returns:
        ``(args, kwargs)`` with their tensors on ``device``.
    """
    if device is None:
        return args, kwargs
    skip = _skip_set(skip_keys)
    if _settled(args, device):
        for key, value in kwargs.items():
            if key not in skip and not _settled(value, device):
                break
        else:
            return args, kwargs
    return _move(args, device, False, _NO_SKIP), _move(kwargs, device, False, skip)


def _move(obj: Any, device: Any, non_blocking: bool, skip: frozenset[str]) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device == device or obj.device.type == "meta":  # already there: no .to() call
            return obj
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, _LEAVES):
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
            return to(device, non_blocking=non_blocking)
        except TypeError:  # a .to() without non_blocking (or not about devices at all)
            pass
        except RuntimeError:
            return obj
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
    """The device of the first tensor found in ``obj``, or None.

    Walks tensors, tuples/lists (namedtuples too), any :class:`~collections.abc.Mapping`
    (dict, ``OrderedDict``, ``UserDict``, ``BatchEncoding``, ``ModelOutput``) and dataclasses —
    the containers :func:`send_to_device` moves.
    """
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, Mapping):
        items: Iterable[Any] = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (tuple, list)):
        items = obj
    else:
        return None
    for item in items:
        device = find_device(item)
        if device is not None:
            return device
    return None


@contextlib.contextmanager
def own_parameters_moved(module: nn.Module, execution_device: Any) -> Iterator[None]:
    """Put ``module``'s direct parameters on ``execution_device`` for the context.

    Only ``module``'s own parameters move (its submodules may be offloaded, or elsewhere).  A
    parameter keeps its object (``param.data`` is swapped) when torch allows it; otherwise (to
    or from ``meta``) a stand-in Parameter is used inside the context and the original object
    is put back on exit.  Either way ties and references survive the context, and a value
    changed inside it is copied back.  Parameters on ``meta`` (no data to move) stay there.

    Args:
        module: the module whose direct parameters move.
        execution_device: device spec; None moves nothing.
    """
    if execution_device is None:
        yield
        return
    device = torch_device(execution_device)
    names: dict[int, list[str]] = {}
    for name, param in module._parameters.items():
        if param is not None and param.device != device and not param.is_meta:
            names.setdefault(id(param), []).append(name)
    moved = [_move_parameter(module, attrs, device) for attrs in names.values()]
    try:
        yield
    finally:
        for attrs, original, data in moved:
            value = module._parameters[attrs[0]].data
            if not value.is_meta and value.shape == data.shape:
                data.copy_(value)  # in-place changes made inside the context are kept
            original.data = data
            for attr in attrs:
                module._parameters[attr] = original


def _move_parameter(module: nn.Module, attrs: list[str], device: torch.device) -> tuple[list[str], nn.Parameter, Any]:
    """Move the parameter held under ``attrs`` to ``device``; returns what restoring it needs."""
    original = module._parameters[attrs[0]]
    data = original.data
    value = data.to(device)
    if torch._has_compatible_shallow_copy_type(data, value):
        original.data = value
    else:  # e.g. cpu <-> meta: torch refuses to swap .data, use a stand-in for the context
        stand_in = nn.Parameter(value, requires_grad=original.requires_grad)
        for attr in attrs:
            module._parameters[attr] = stand_in
    return attrs, original, data
