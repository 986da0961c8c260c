"""``AlignDevicesHook``: bring a module's inputs and (offloaded) weights to its execution device.

An offloaded module keeps, between forwards, a *placeholder* on the ``meta`` device for
each offloaded tensor; the real values stay in ``hook.weights_map`` (a dict, or the
read-only ``OffloadedWeightsLoader`` over RAM and disk).  ``pre_forward`` puts the values
in (no copy when the value is already on the execution device with the right dtype, e.g.
an mmap view of a safetensors file and a CPU execution device); ``post_forward`` puts the
placeholders back, so the values' memory is the weights map's alone.

Placeholders of parameters are :class:`OffloadedParameter` objects: on ``meta`` like any
offloaded tensor (``.device``, ``.shape``, ``state_dict()`` see ``meta``), but when an op
uses one outside its module's forward (a parent module reading ``self.child.weight``
directly), the value is loaded from the weights map for that op, with a one-time warning
suggesting ``preload_module_classes``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..core.devices import torch_device
from ..core.tensors import (
    get_non_persistent_buffers,
    get_submodule_and_name,
    named_module_tensors,
    set_module_tensor_to_device,
)
from ..offload.quantized_store import read_offloaded, take_dequantized
from .moving import find_device, send_inputs_to_device, send_to_device
from .registry import ModelHook, iter_hooks

logger = logging.getLogger(__name__)

# Tensor attributes/methods that only read metadata: a placeholder answers them itself (meta).
_METADATA = frozenset(
    "device shape dtype is_meta requires_grad ndim layout is_cuda is_cpu is_sparse is_quantized is_leaf grad "
    "grad_fn data _version names itemsize nbytes size dim numel nelement stride element_size is_floating_point "
    "is_complex is_contiguous __repr__ __format__ __reduce_ex__ __deepcopy__ detach requires_grad_ __hash__ "
    "__len__ __bool__ storage_offset untyped_storage _typed_storage __setstate__ __set__ __get__".split()
)
_WARNED: set[tuple[str, str]] = set()
_HOOK_DEVICE: Any = object()  # load_value's default: the hook's own execution device


def _func_name(func: Callable) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", name)
    return name


class OffloadedParameter(nn.Parameter):
    """Meta placeholder of an offloaded parameter that loads its value when an op uses it."""

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if _func_name(func) not in _METADATA:
                args, kwargs = tree_map(_materialize, (args, kwargs))
            return func(*args, **kwargs)


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
            "Offloaded tensor %r was used outside its module's forward (a parent module reads a child's "
            "weight directly); it is loaded for each such use. Add the parent's class to "
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
class _Slot:
    """What an offloaded tensor looked like before offload (to rebuild it around a value)."""

    placeholder: torch.Tensor
    is_parameter: bool
    param_type: type
    requires_grad: bool
    extra: dict
    dtype: torch.dtype | None = None  # the placeholder's dtype if floating (read without its __torch_function__)


def _floating_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    return tensor.dtype if tensor.is_floating_point() else None


def _make_slot(hook: AlignDevicesHook, name: str, tensor: torch.Tensor, is_parameter: bool) -> _Slot:
    meta = tensor.detach().to("meta")
    if not is_parameter:
        return _Slot(meta, False, torch.Tensor, False, {}, _floating_dtype(meta))
    extra = {k: v for k, v in tensor.__dict__.items() if k not in ("requires_grad", "_bm_source")}
    param_type = type(tensor) if not isinstance(tensor, OffloadedParameter) else nn.Parameter
    if param_type is nn.Parameter:
        placeholder = OffloadedParameter(meta, requires_grad=tensor.requires_grad)
        placeholder.__dict__["_bm_source"] = (weakref.ref(hook), name)
    else:  # quantised parameter subclasses keep their own type on meta
        placeholder = param_type(meta, requires_grad=tensor.requires_grad, **extra)
    return _Slot(placeholder, True, param_type, tensor.requires_grad, extra, _floating_dtype(meta))


def _assign(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    sub, attr = get_submodule_and_name(module, name) if "." in name else (module, name)
    if attr in sub._parameters:
        sub._parameters[attr] = tensor  # type: ignore[assignment]
    else:
        sub._buffers[attr] = tensor


class AlignDevicesHook(ModelHook):
    """Puts a module's inputs, and its weights if ``offload``, on ``execution_device`` for its forward.

    Args:
        execution_device: where the forward runs (device spec); None leaves inputs and weights alone.
        offload: keep the module's weights in ``weights_map`` and on ``meta`` between forwards.
        io_same_device: move outputs back to the device of the first input tensor.
        weights_map: Mapping name → tensor holding the offloaded values (names relative to the
            module); built from the module's current tensors (on CPU) when None.
        offload_buffers: offload buffers too (else they live on ``execution_device``).
        place_submodules: treat the tensors of all submodules as this module's (dotted names).
        skip_keys: input/output mapping keys never moved.
        tied_params_map: ``data_ptr → {device: tensor}`` shared by the hooks of one model, so a
            tied value is put on a device once while any module using it runs.
    """

    def __init__(
        self,
        execution_device: Any = None,
        offload: bool = False,
        io_same_device: bool = False,
        weights_map: Mapping[str, torch.Tensor] | None = None,
        offload_buffers: bool = False,
        place_submodules: bool = False,
        skip_keys: str | list[str] | None = None,
        tied_params_map: dict[int, dict[torch.device, torch.Tensor]] | None = None,
    ) -> None:
        self.execution_device = execution_device
        self.offload = offload
        self.io_same_device = io_same_device
        self.weights_map = weights_map
        self.offload_buffers = offload_buffers
        self.place_submodules = place_submodules
        self.skip_keys = skip_keys
        self.tied_params_map = tied_params_map
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}
        self.tied_pointers_to_remove: set[tuple[int, torch.device]] = set()
        self.module_name = ""
        self.prefetcher: Any = None  # set by _prefetch.enable_prefetch
        self._slots: dict[str, _Slot] = {}

    _REPR_FIELDS = ("execution_device", "offload", "io_same_device", "offload_buffers", "place_submodules",
                    "skip_keys")

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._REPR_FIELDS)
        return f"{type(self).__name__}({fields})"

    @property
    def device(self) -> torch.device | None:
        """The execution device as a :class:`torch.device` (None when not set)."""
        spec = self.execution_device
        cached = self.__dict__.get("_device_of")
        if cached is None or cached[0] is not spec:  # execution_device may be reassigned (align_module_device)
            cached = (spec, None if spec is None else torch_device(spec))
            self.__dict__["_device_of"] = cached
        return cached[1]

    @property
    def offloaded_names(self) -> list[str]:
        """Names (relative to the module) of the tensors this hook offloads."""
        return list(self._slots)

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of the offloaded tensors (in the module's dtypes)."""
        return sum(slot.placeholder.numel() * slot.placeholder.element_size() for slot in self._slots.values())

    def init_hook(self, module: nn.Module) -> nn.Module:
        if self.offload:
            self._offload_module(module)
        elif self.execution_device is not None:
            for name, tensor in named_module_tensors(module, recurse=self.place_submodules):
                self.original_devices[name] = tensor.device
                set_module_tensor_to_device(
                    module, name, self.execution_device, tied_params_map=self.tied_params_map, clear_cache=False
                )
        return module

    def _offload_module(self, module: nn.Module) -> None:
        tensors = list(
            named_module_tensors(
                module, include_buffers=self.offload_buffers, recurse=self.place_submodules, remove_non_persistent=True
            )
        )
        if self.weights_map is None:
            self.weights_map = {name: t.detach().to("cpu") for name, t in tensors}
        missing = [name for name, _ in tensors if name not in self.weights_map]
        if missing:  # checked before any tensor is replaced: the module keeps its values
            where = f" {self.module_name!r}" if self.module_name else ""
            raise ValueError(
                f"weights_map has no value for {len(missing)} tensor(s) of {type(module).__name__}{where}: "
                f"{missing[:10]}; pass a weights_map holding every offloaded tensor (names relative to the "
                "module), or weights_map=None to offload the module's own values."
            )
        params = {name for name, _ in module.named_parameters(recurse=self.place_submodules)}
        for name, tensor in tensors:
            self.original_devices[name] = tensor.device
            slot = _make_slot(self, name, tensor, name in params)
            self._slots[name] = slot
            _assign(module, name, slot.placeholder)
        if self.execution_device is None:
            return
        if self.offload_buffers:
            names = get_non_persistent_buffers(module, recurse=self.place_submodules, fqns=True)
        else:
            names = [name for name, _ in module.named_buffers(recurse=self.place_submodules)]
        for name in names:
            set_module_tensor_to_device(module, name, self.execution_device, clear_cache=False)

    def load_value(self, name: str, value: torch.Tensor, device: Any = _HOOK_DEVICE) -> torch.Tensor:
        """``value`` of tensor ``name`` as the module should hold it: on the execution device
        (``device``, when the caller already resolved :attr:`device`), in the placeholder's
        floating dtype, wrapped as a Parameter if it was one.  No copy when the value already
        has that device and dtype."""
        slot = self._slots[name]
        if device is _HOOK_DEVICE:
            device = self.device
        if device is not None and value.device != device:
            # Asynchronous only towards an accelerator: a device→host copy must be complete when used.
            value = value.to(device, non_blocking=device.type != "cpu")
        if slot.dtype is not None and value.dtype != slot.dtype and value.is_floating_point():
            value = value.to(slot.dtype)
        if not slot.is_parameter:
            return value
        requires_grad = slot.requires_grad and value.is_floating_point()
        if slot.param_type is nn.Parameter:
            return nn.Parameter(value, requires_grad=requires_grad)
        return slot.param_type(value, requires_grad=requires_grad, **slot.extra)

    def stored_value(self, name: str) -> torch.Tensor:
        """A copy of the offloaded value of ``name``: a CPU tensor in the module's dtype, sharing no
        memory with the weights map (changing it never changes the model)."""
        value = self.weights_map[name].detach()  # type: ignore[index]
        dtype = self._slots[name].dtype if value.is_floating_point() else None
        return value.to(device="cpu", dtype=dtype or value.dtype, copy=True)

    def load_weights(self, module: nn.Module, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Put the offloaded values into ``module`` (from ``values`` if given, else the weights map)."""
        source = read_offloaded(self.weights_map, self._slots) if values is None else values  # type: ignore[arg-type]
        device = self.device
        tied_map = self.tied_params_map
        for name in self._slots:
            dequantized = take_dequantized(self.weights_map, source, name, device)  # type: ignore[arg-type]
            value = source[name] if dequantized is None else dequantized
            per_device = None
            if tied_map and not value.is_meta:  # a tied value is put on a device once while it is in use
                per_device = tied_map.get(value.data_ptr())
                if per_device is not None and device in per_device:
                    _assign(module, name, per_device[device])
                    continue
            loaded = self.load_value(name, value, device)
            if per_device is not None:
                per_device[device] = loaded
                self.tied_pointers_to_remove.add((value.data_ptr(), device))
            _assign(module, name, loaded)

    def unload_weights(self, module: nn.Module) -> None:
        """Put the meta placeholders back (the values' memory belongs to the weights map again)."""
        for name, slot in self._slots.items():
            _assign(module, name, slot.placeholder)
        for pointer, device in self.tied_pointers_to_remove:
            self.tied_params_map.get(pointer, {}).pop(device, None)  # type: ignore[union-attr]
        self.tied_pointers_to_remove.clear()

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        if self.offload:
            staged = self.prefetcher.take(self) if self.prefetcher is not None else None
            self.load_weights(module, staged)
            if self.prefetcher is not None:
                self.prefetcher.schedule_after(self)
        return send_inputs_to_device(args, kwargs, self.device, self.skip_keys)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self.unload_weights(module)
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def forward_failed(self, module: nn.Module) -> None:
        """The forward raised: put the meta placeholders back so the loaded weights are freed."""
        if self.offload and self._slots:
            self.unload_weights(module)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        if not self.offload:
            return module
        for name, slot in self._slots.items():
            value = self.weights_map[name]  # type: ignore[index]
            original = self.original_devices.get(name)
            if original is not None and original.type != "meta" and value.device != original:
                value = value.to(original)
            if value.is_floating_point() and value.dtype != slot.placeholder.dtype:
                value = value.to(slot.placeholder.dtype)
            if slot.is_parameter:
                requires_grad = slot.requires_grad and value.is_floating_point()
                if slot.param_type is nn.Parameter:
                    value = nn.Parameter(value, requires_grad=requires_grad)
                else:
                    value = slot.param_type(value, requires_grad=requires_grad, **slot.extra)
            _assign(module, name, value)
        self._slots.clear()
        return module


def offload_hook_of(module: nn.Module) -> AlignDevicesHook | None:
    """The offloading AlignDevicesHook of ``module`` (also inside a SequentialHook), or None."""
    for hook in iter_hooks(module.__dict__.get("_hf_hook")):
        if isinstance(hook, AlignDevicesHook) and hook.offload:
            return hook
    return None


def has_offloaded_params(module: nn.Module) -> bool:
    """True if ``module`` has an AlignDevicesHook that offloads its weights.

    Args:
        module: any module.

    Returns:
        Whether the module's weights live in a weights map (and on ``meta`` between forwards).
    """
    return offload_hook_of(module) is not None
