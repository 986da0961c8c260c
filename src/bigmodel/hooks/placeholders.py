"""Meta placeholders: what an offloaded module holds, between forwards, in place of each offloaded tensor.

A placeholder is the one place where everything a user can change on an offloaded tensor
without touching its value lives; the offloading hook reads it each time it loads the value:

- its **dtype**: ``model.to(torch.float64)``, ``.half()``... cast the placeholder (on ``meta``,
  nothing is read) and the hook casts the value to it when it loads it;
- its **requires_grad**: ``model.requires_grad_(False)`` sets it, and the Parameter the forward
  computes with gets it;
- its **identity**: tied names share one placeholder, as they shared one Parameter.

Placeholders of parameters are :class:`OffloadedParameter` objects: on ``meta`` like any
offloaded tensor (``.device``, ``.shape``, ``state_dict()`` see ``meta``), but when an op uses
one outside its module's forward (a parent module reading ``self.child.weight`` directly), the
value is loaded from the weights map for that op, with a one-time warning suggesting
``preload_module_classes``.  Inside :func:`placeholders_stay_meta` they act as plain meta
tensors (a model-wide cast changes their dtype without reading any value).

A wrapper tensor subclass (torchao's quantized weights) gets a *plain* meta placeholder of its
outer shape and dtype, not a subclass on ``meta``: most such subclasses implement neither
``empty_like`` nor the ops a placeholder must answer on ``meta``, and a plain placeholder keeps
everything above (casts, ``requires_grad``, ties, use outside the forward) working the same way.
The value the module computes with in its forward is the subclass itself.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..core.subclasses import is_tensor_subclass, stored_nbytes
from ..core.tensors import get_submodule_and_name

logger = logging.getLogger(__name__)

__all__ = [
    "MissingOffloadedValueError", "OffloadedParameter", "Slot", "assign_tensor", "check_values_present", "make_slot",
    "offload_source", "placeholder_state", "placeholders_report_execution_device", "placeholders_stay_meta",
]

# Tensor attributes/methods that only read metadata: a placeholder answers them itself (meta).
_METADATA = frozenset(
    "device shape dtype is_meta requires_grad ndim layout is_cuda is_cpu is_sparse is_quantized is_leaf grad "
    "grad_fn data _version names itemsize nbytes size dim numel nelement stride element_size is_floating_point "
    "is_complex is_contiguous __repr__ __format__ __reduce_ex__ __deepcopy__ detach requires_grad_ __hash__ "
    "__len__ __bool__ storage_offset untyped_storage _typed_storage __setstate__ __set__ __get__".split()
)
_WARNED: set[tuple[str, str]] = set()
_LOCAL = threading.local()  # .stay_meta: placeholders act as plain meta tensors (this thread only)


def _func_name(func: Callable) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


class OffloadedParameter(nn.Parameter):
    """Meta placeholder of an offloaded parameter that loads its value when an op uses it."""

    # A value set in its place (set_module_tensor_to_device) is held as a plain nn.Parameter.
    replaced_by_plain_parameter = True

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            name = _func_name(func)
            if name not in _METADATA and not getattr(_LOCAL, "stay_meta", False):
                args, kwargs = tree_map(_materialize, (args, kwargs))
            elif name == "device" and getattr(_LOCAL, "report_device", False) and args:
                return _execution_device(args[0]) or func(*args, **kwargs)
            return func(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> OffloadedParameter:
        """A new placeholder (same dtype, shape, requires_grad) whose value comes from a copy of its hook."""
        if id(self) in memo:
            return memo[id(self)]
        with torch._C.DisableTorchFunctionSubclass():
            result = type(self)(torch.empty_like(self), requires_grad=self.requires_grad)
        memo[id(self)] = result
        source = self.__dict__.get("_bm_source")
        hook = source[0]() if source else None
        if hook is not None:  # the hook's copy holds this copy in its slots (memo): no recursion
            result.__dict__["_bm_source"] = (weakref.ref(copy.deepcopy(hook, memo)), source[1])
        return result


@contextlib.contextmanager
def placeholders_stay_meta() -> Iterator[None]:
    """Inside the context (this thread), ops on placeholders never load values: they act on ``meta``."""
    with _flag_set("stay_meta"):
        yield


@contextlib.contextmanager
def placeholders_report_execution_device() -> Iterator[None]:
    """Inside the context (this thread), ``placeholder.device`` is where its module computes.

    For code that places new tensors "next to" a layer's weight (peft puts each new adapter on
    ``base_layer.weight.device``): an offloaded weight then answers its hook's execution device
    (the CPU for a hook without one) instead of ``meta``, so what is put there keeps its values.
    Everything else about the placeholder is unchanged: it is still on ``meta`` (``is_meta``,
    ``state_dict()``), and an op that uses it loads its value as outside the context.
    """
    with _flag_set("report_device"):
        yield


@contextlib.contextmanager
def _flag_set(name: str) -> Iterator[None]:
    """Thread-local flag ``name`` True inside the context, as it was after it."""
    previous = getattr(_LOCAL, name, False)
    setattr(_LOCAL, name, True)
    try:
        yield
    finally:
        setattr(_LOCAL, name, previous)


def _execution_device(placeholder: torch.Tensor) -> torch.device | None:
    """The execution device of the hook that loads ``placeholder``'s value (None: no such hook)."""
    source = placeholder.__dict__.get("_bm_source")
    hook = source[0]() if source else None
    if hook is None:
        return None
    return hook.device or torch.device("cpu")


def offload_source(tensor: torch.Tensor) -> tuple[Any, str] | None:
    """``(hook, name)``: the offloading hook that loads placeholder ``tensor``'s value and the tensor's
    name relative to the hook's module; None for any other tensor (or when that hook is gone)."""
    source = tensor.__dict__.get("_bm_source") if isinstance(tensor, OffloadedParameter) else None
    hook = source[0]() if source else None
    return None if hook is None else (hook, source[1])


def _materialize(obj: Any) -> Any:
    if not isinstance(obj, OffloadedParameter) or obj.device.type != "meta":
        return obj
    source = obj.__dict__.get("_bm_source")
    hook = source[0]() if source else None
    if hook is None:
        return obj
    name = source[1]
    module_name = getattr(hook, "module_name", "")
    full = f"{module_name}.{name}" if module_name else name
    if (module_name, name) not in _WARNED:
        _WARNED.add((module_name, name))
        logger.warning(
            "Offloaded tensor %r was used outside its module's forward (a parent module reading a child's "
            "weight directly, or an op such as load_state_dict's copy); its value in the weights map is used "
            "for each such use. If a parent module reads it in its forward, add the parent's class to "
            "`preload_module_classes` to load it once per forward.",
            full,
        )
    if hook.prefetcher is not None:  # weights-map reads are serialised with the prefetch thread
        with hook.prefetcher.read_lock:
            value = hook.weights_map[name]
    else:
        value = hook.weights_map[name]
    return hook.load_value(name, value)


@dataclass
class Slot:
    """One offloaded tensor of a module: its placeholder, and how to rebuild a value around it.

    ``placeholder`` holds the dtype and requires_grad the value gets (read with
    :func:`placeholder_state` each time it is loaded, never cached here).
    """

    placeholder: torch.Tensor
    is_parameter: bool
    param_type: type = torch.Tensor
    extra: dict | None = None  # __dict__ settings of a Parameter subclass (quantised weights)
    nbytes: int | None = None  # bytes of the value when not the placeholder's numel × itemsize (a wrapper subclass)
    round_to: torch.dtype | None = None  # each load rounds the stored value to it first (layerwise casting)

    def rounded(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` rounded to :attr:`round_to` (unchanged when there is none, or it is not floating)."""
        if self.round_to is None or value.dtype == self.round_to or not value.is_floating_point():
            return value
        return value.to(self.round_to)

    def wrap(self, value: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        """``value`` as the module holds it: a Parameter of the original class if it was one."""
        if not self.is_parameter:
            return value
        requires_grad = requires_grad and value.is_floating_point()
        if self.param_type is nn.Parameter:
            return nn.Parameter(value, requires_grad=requires_grad)
        return self.param_type(value, requires_grad=requires_grad, **(self.extra or {}))


def check_shape(slot: Slot, value: torch.Tensor, name: str, module_name: str = "") -> None:
    """Refuse a value from a weights map whose shape is not the shape of the tensor its slot replaces.

    Raises:
        ValueError: the shapes differ (names the tensor, both shapes and the fix); a value of another
            shape would otherwise be used as it is (a bias of shape ``[1]`` broadcasts: wrong outputs).
    """
    with torch._C.DisableTorchFunctionSubclass():
        shape = slot.placeholder.shape
    if value.shape != shape and slot.param_type.__name__ != "Params4bit":  # bitsandbytes packs 4-bit weights
        full = f"{module_name}.{name}" if module_name else name
        raise ValueError(
            f"Offloaded tensor {full!r} has shape {list(value.shape)} in its weights map (offload folder) but "
            f"{list(shape)} in the model: they hold another model's weights; offload this model again, or pass "
            "the offload folder (weights map) written for it."
        )


def placeholder_state(slot: Slot) -> tuple[torch.dtype | None, bool]:
    """``(floating dtype or None, requires_grad)`` of a slot's placeholder, read without its ``__torch_function__``."""
    with torch._C.DisableTorchFunctionSubclass():
        placeholder = slot.placeholder
        dtype = placeholder.dtype
        return (dtype if dtype.is_floating_point else None), placeholder.requires_grad


def placeholder_states(slots: dict[str, Slot], names: Iterable[str] | None = None,
                       ) -> list[tuple[str, Slot, torch.dtype | None, bool]]:
    """:func:`placeholder_state` of every slot (of those named in ``names``, in that order), in one pass:
    ``[(name, slot, dtype, requires_grad)]``."""
    with torch._C.DisableTorchFunctionSubclass():
        states = []
        for name in slots if names is None else names:
            slot = slots[name]
            placeholder = slot.placeholder
            dtype = placeholder.dtype
            states.append((name, slot, dtype if dtype.is_floating_point else None, placeholder.requires_grad))
        return states


def make_slot(hook: Any, name: str, tensor: torch.Tensor, is_parameter: bool) -> Slot:
    """The slot replacing ``tensor`` (tensor ``name`` of ``hook``'s module) while it is offloaded.

    A wrapper tensor subclass (torchao's quantized weights) gets a plain meta placeholder of its
    outer shape and dtype (such subclasses mostly cannot live on ``meta``): between forwards the
    module holds an ordinary placeholder, and in its forward the subclass itself, rebuilt from
    its parts on the execution device.
    """
    if is_tensor_subclass(tensor):
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        if not is_parameter:
            return Slot(meta, False, nbytes=stored_nbytes(tensor))
        placeholder = OffloadedParameter(meta, requires_grad=tensor.requires_grad)
        placeholder.__dict__["_bm_source"] = (weakref.ref(hook), name)
        return Slot(placeholder, True, nn.Parameter, None, stored_nbytes(tensor))
    meta = tensor.detach().to("meta")
    source = offload_source(tensor)
    old_slot = source[0].slot(source[1]) if source is not None else None
    round_to = old_slot.round_to if old_slot is not None else None  # offloaded again: still rounded
    if not is_parameter:
        return Slot(meta, False)
    extra = {k: v for k, v in tensor.__dict__.items() if k not in ("requires_grad", "_bm_source")}
    param_type = type(tensor) if not isinstance(tensor, OffloadedParameter) else nn.Parameter
    if param_type is nn.Parameter:
        placeholder = OffloadedParameter(meta, requires_grad=tensor.requires_grad)
        placeholder.__dict__["_bm_source"] = (weakref.ref(hook), name)
    else:  # quantised parameter subclasses keep their own type on meta
        placeholder = param_type(meta, requires_grad=tensor.requires_grad, **extra)
    return Slot(placeholder, True, param_type, extra, round_to=round_to)


def assign_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make ``tensor`` what ``module`` holds for parameter or buffer ``name`` (dotted: of a submodule), as it is."""
    sub, attr = get_submodule_and_name(module, name) if "." in name else (module, name)
    if attr in sub._parameters:
        sub._parameters[attr] = tensor  # type: ignore[assignment]
    else:
        sub._buffers[attr] = tensor


def follow_held_dtype(module: nn.Module, name: str, slot: Slot) -> None:
    """Give ``slot``'s placeholder the floating dtype of the value ``module`` holds for ``name`` (if it differs).

    Called with torch functions of subclasses disabled (the placeholder is read and cast as a plain meta tensor).
    """
    sub, attr = get_submodule_and_name(module, name) if "." in name else (module, name)
    held = sub._parameters.get(attr)
    placeholder = slot.placeholder
    if held is None or held is placeholder or held.dtype == placeholder.dtype:
        return
    if held.is_floating_point() and placeholder.is_floating_point():
        placeholder.data = placeholder.data.to(held.dtype)


def inner_hook_follows(module: nn.Module, hook: Any) -> bool:
    """True if a ``runs_innermost`` hook of ``module`` (e.g. layerwise casting) runs its post_forward after ``hook``."""
    chain = getattr(module.__dict__.get("_hf_hook"), "hooks", ())
    return any(getattr(other, "runs_innermost", False) for other in chain if other is not hook)


def adopt_replaced_buffers(slots: dict[str, Slot], module: nn.Module) -> None:
    """Take as placeholder a buffer placeholder ``module`` now holds instead of its slot's: ``module.to(dtype)``
    replaces buffers by new (meta) tensors where it casts parameters in place."""
    for name, slot in slots.items():
        if slot.is_parameter:
            continue
        owner, _, leaf = name.rpartition(".")
        held = (module.get_submodule(owner) if owner else module)._buffers.get(leaf)
        if held is not None and held is not slot.placeholder and held.is_meta:
            slot.placeholder = held


class MissingOffloadedValueError(KeyError, ValueError):
    """A weights map lacks the values of tensors a hook offloads (their names are in the message).

    Both a :class:`KeyError` (accelerate's hook raises one when it looks the value up at the
    forward, and code written for it catches that) and a :class:`ValueError`.
    """

    def __str__(self) -> str:  # the message as given (KeyError would quote it)
        return str(self.args[0]) if self.args else ""


def check_values_present(hook: Any, module: nn.Module, names: Iterable[str]) -> None:
    """Refuse to offload ``module`` if ``hook.weights_map`` lacks the value of one of ``names``.

    Raises:
        MissingOffloadedValueError: naming the module and the missing tensors (before any is replaced).
    """
    missing = [name for name in names if name not in hook.weights_map]
    if missing:
        where = f" {hook.module_name!r}" if hook.module_name else ""
        raise MissingOffloadedValueError(
            f"weights_map has no value for {len(missing)} tensor(s) of {type(module).__name__}{where}: "
            f"{missing[:10]}; pass a weights_map holding every offloaded tensor (names relative to the "
            "module), or weights_map=None to offload the module's own values."
        )


def adopt_registered_parameters(hook: Any, module: nn.Module) -> bool:
    """Give a slot to each ``meta`` parameter registered on ``module`` after ``hook`` offloaded it whose
    value ``hook.weights_map`` holds (compressed-tensors registers quantization scales this way), so
    it is put in at each forward, as accelerate loads every tensor the weights map holds.

    Returns:
        True if a parameter was adopted (values staged before it lack it: read them again).
    """
    slots = hook._slots
    if hook.place_submodules or len(module._parameters) <= len(slots):
        return False
    new = [(name, p) for name, p in module._parameters.items()
           if p is not None and name not in slots and p.is_meta and name in hook.weights_map]  # fmt: skip
    for name, tensor in new:
        slots[name] = make_slot(hook, name, tensor, is_parameter=True)
        module._parameters[name] = slots[name].placeholder
    return bool(new)
