"""Loaded values kept from one forward to the next, where the values are used in place.

On a CPU execution device the value an offloading hook puts in for a tensor is usually a view
of memory its weights map holds anyway (a memory-mapped safetensors file, a tensor of a dict),
wrapped as a Parameter: nothing is copied.  Reading the weights map and building that Parameter
is then most of the hook's work.  The hook keeps the Parameter (or buffer) it built and puts the
same object in at the next forward, as a plain model holds the same Parameter at every forward,
while everything the value is built from is unchanged:

- the hook's execution device is the one the value was built for (``hook.execution_device`` may be
  reassigned, as ``align_module_device`` does: a load then puts the value there);
- the weights map holds the same value: the same object in a dict, the same mapped view (or
  in-memory entry) of an ``OffloadedWeightsLoader``, with the same version counter (an in-place op
  on it, such as ``t_()`` or ``resize_``, may change its shape or strides over the same memory) (asked with
  :func:`bigmodel.offload.storage.value_token_getter`; any other map: nothing is kept);
- the placeholder has the same dtype and ``requires_grad`` (``model.to(dtype)``,
  ``requires_grad_`` act on it), and the slot rounds nothing (layerwise casting);
- the kept object still views that memory, requires grad as built and has no ``.grad``
  (code in a forward that re-pointed ``.data`` or changed it leaves nothing behind).

Only values that share the weights map's memory are kept (a copy to another device or dtype is
never kept alive between forwards); nothing is kept from inside ``torch.inference_mode`` (an
inference tensor would break later forwards that record gradients), and a Parameter that
requires grad is neither kept nor put in again while gradients are recorded (a ``.grad`` never
outlives its forward).  A copy of a hook (``copy.deepcopy(model)``) keeps nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..offload.storage import value_token_getter
from .placeholders import Slot, assign_tensor

TokenSource = tuple[Callable[[str], Any], str]  # (get, prefix): get(prefix + name) is the value's token


class Kept:
    """A value put in at an earlier forward, and what it was built from."""

    __slots__ = ("dtype", "key", "loaded", "loaded_requires_grad", "pointer", "requires_grad", "simple", "token",
                 "version")

    def __init__(self, token: Any, key: str, pointer: int, placeholder: torch.Tensor, loaded: torch.Tensor,
                 simple: bool) -> None:
        self.token, self.key, self.pointer, self.loaded = token, key, pointer, loaded
        self.version = token._version  # bumped by any in-place op on the value (metadata ones included)
        self.dtype, self.requires_grad = placeholder.dtype, placeholder.requires_grad  # the placeholder's
        self.loaded_requires_grad = loaded.requires_grad
        self.simple = simple  # a Parameter of the hook's module itself (not of a submodule)


class KeptValues(dict):
    """Name → :class:`Kept` of one hook; any copy of it is empty (a copied hook builds its own values)."""

    source: tuple[Any, TokenSource | None] | None = None  # (the weights map, value_token_getter of it)
    device: torch.device | None = None  # the hook's execution device the values were built for
    spec: Any = None  # hook.execution_device as it was then (an identity check first: it is rarely reassigned)

    def __deepcopy__(self, memo: dict) -> KeptValues:
        return KeptValues()

    def __copy__(self) -> KeptValues:
        return KeptValues()

    def __reduce__(self) -> tuple:
        return (KeptValues, ())


def token_source(hook: Any, values: Any) -> TokenSource | None:
    """How to ask ``hook``'s weights map whether a kept value is still current; None when values are
    given (staged by a prefetch, or copies from ``align_module_device``) or the map cannot tell."""
    kept = hook.__dict__.get("_kept")
    if values is not None or kept is None:
        return None
    weights_map = hook.weights_map
    cached = kept.source
    spec = hook.execution_device
    if kept.spec is not spec:  # reassigned (align_module_device does): values built for another device go
        device = hook.device
        if kept.device != device:
            kept.clear()
            cached = kept.source = None
        kept.spec, kept.device = spec, device
    if cached is None or cached[0] is not weights_map:  # another map: nothing kept from the old one is current
        kept.clear()
        cached = kept.source = (weights_map, value_token_getter(weights_map))  # type: ignore[arg-type]
    return cached[1]


def put_in_kept(hook: Any, module: nn.Module, source: TokenSource, grad: bool | None = None) -> list[str]:
    """Put in each of ``hook``'s kept values that is still what a load would build (ties as a load does).

    Returns:
        The names of the offloaded tensors not served (to load as usual), in slot order.
    """
    kept = hook._kept
    if not kept:
        return list(hook._slots)
    get = source[0]
    grad = torch.is_grad_enabled() if grad is None else grad
    tied_map = hook.tied_params_map
    device = hook.device
    rest = []
    with torch._C.DisableTorchFunctionSubclass():
        for name, slot in hook._slots.items():
            entry = kept.get(name)
            if entry is None or not _current(entry, slot, get(entry.key), grad):
                rest.append(name)
                continue
            loaded = entry.loaded
            per_device = tied_map.get(entry.pointer) if tied_map else None
            if per_device is not None:  # a tied value is put on a device once
                other = per_device.get(device)
                if other is not None:
                    assign_tensor(module, name, other)
                    continue
                per_device[device] = loaded
                hook.tied_pointers_to_remove.add((entry.pointer, device))
            assign_tensor(module, name, loaded)
    return rest


def put_in_all_kept(hook: Any, module: nn.Module, grad: bool) -> bool:
    """The common case of :meth:`~bigmodel.hooks.align_hook.AlignDevicesHook.load_weights` in one pass:
    True if every offloaded tensor of ``hook`` (Parameters of ``module`` itself, none tied) was put in
    from its kept value; False when a load must do it (it may have put some in: a load puts all in)."""
    slots = hook._slots
    params = module._parameters
    if len(params) > len(slots) and not hook.place_submodules:
        for param_name, param in params.items():
            if param is not None and param_name not in slots:
                return False  # registered since it was offloaded: a load may adopt it
    if not slots:
        return True
    kept = hook.__dict__.get("_kept")
    cached = kept.source if kept else None
    if (cached is None or cached[0] is not hook.weights_map or cached[1] is None
            or kept.spec is not hook.execution_device):
        return False  # a load asks the (new) weights map how to tell, or loads for the new device
    get, tied_map = cached[1][0], hook.tied_params_map
    with torch._C.DisableTorchFunctionSubclass():
        for name, slot in slots.items():
            entry = kept.get(name)
            if entry is None or not entry.simple:
                return False
            if not _current(entry, slot, get(entry.key), grad) or (tied_map and entry.pointer in tied_map):
                return False
            params[name] = entry.loaded
    return True


def put_back_all_kept(hook: Any, module: nn.Module) -> bool:
    """The common case of :meth:`~bigmodel.hooks.align_hook.AlignDevicesHook.unload_weights` in one pass:
    True if ``module`` held the kept value of each offloaded tensor of ``hook`` (its only hook), in its
    placeholder's dtype, and the placeholders are back; False when an unload must do it."""
    slots = hook._slots
    if not slots:
        return not hook.tied_pointers_to_remove
    kept = hook.__dict__.get("_kept")
    if not kept or hook.tied_pointers_to_remove or module.__dict__.get("_hf_hook") is not hook:
        return False
    params = module._parameters
    with torch._C.DisableTorchFunctionSubclass():
        for name, slot in slots.items():
            entry = kept.get(name)
            if entry is None or not entry.simple:
                return False
            held = params.get(name)
            if held is not entry.loaded or held.dtype is not slot.placeholder.dtype:
                return False  # an unload has the placeholder follow the held dtype
            params[name] = slot.placeholder
    return True


def _current(entry: Kept, slot: Slot, token: Any, grad: bool) -> bool:
    """True if ``entry`` is what a load of ``slot`` would build now (torch functions of subclasses disabled)."""
    placeholder, loaded = slot.placeholder, entry.loaded
    return (
        token is entry.token
        and token._version == entry.version
        and placeholder.dtype is entry.dtype
        and placeholder.requires_grad is entry.requires_grad
        and slot.round_to is None
        and not (grad and entry.loaded_requires_grad)
        and loaded.requires_grad is entry.loaded_requires_grad
        and loaded.grad is None
        and loaded.data_ptr() == entry.pointer
        and token.data_ptr() == entry.pointer
    )


def keep_value(hook: Any, source: TokenSource, name: str, slot: Slot, value: torch.Tensor,
               loaded: torch.Tensor) -> None:
    """Keep ``loaded`` (built from ``value``, read from the weights map) for the next forwards if it
    views the weights map's memory and may be kept (see the module docstring); else drop what was kept."""
    kept = hook._kept
    kept.pop(name, None)
    if slot.round_to is not None or (slot.is_parameter and slot.param_type is not nn.Parameter):
        return
    if torch.is_inference_mode_enabled() or (loaded.requires_grad and torch.is_grad_enabled()):
        return
    with torch._C.DisableTorchFunctionSubclass():
        pointer = value.data_ptr()
        if (not pointer or value.is_meta or loaded.data_ptr() != pointer or loaded.device != value.device
                or loaded.dtype != value.dtype or loaded.is_inference()):
            return
        key = source[1] + name
        token = source[0](key)
        if token is None or token.data_ptr() != pointer:
            return
        simple = slot.is_parameter and "." not in name
        kept[name] = Kept(token, key, pointer, slot.placeholder, loaded, simple)
