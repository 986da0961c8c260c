"""``AlignDevicesHook``: bring a module's inputs and (offloaded) weights to its execution device.

An offloaded module keeps, between forwards, a *placeholder* on the ``meta`` device for
each offloaded tensor; the real values stay in ``hook.weights_map`` (a dict, or the
read-only ``OffloadedWeightsLoader`` over RAM and disk).  ``pre_forward`` puts the values
in (no copy when the value is already on the execution device with the right dtype, e.g.
an mmap view of a safetensors file and a CPU execution device); ``post_forward`` puts the
placeholders back, so the values' memory is the weights map's alone.

The placeholders (dtype, requires_grad and identity of each offloaded tensor live there) are
:mod:`bigmodel.hooks.placeholders`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..core.devices import torch_device
from ..core.subclasses import flatten_tensor, is_tensor_subclass, unflatten_tensor
from ..core.tensors import (
    get_non_persistent_buffers,
    named_module_tensors,
    set_module_tensor_to_device,
)
from ..offload.quantized_store import read_offloaded, take_dequantized, take_subclass
from .kept import KeptValues, keep_value, put_in_kept, token_source
from .block_plan import PlanSlot
from .members import restore_members, take_members
from .moving import checked_skip_keys, find_device, send_inputs_to_device, send_to_device
from .placeholders import (
    Slot,
    adopt_registered_parameters,
    adopt_replaced_buffers,
    assign_tensor,
    check_shape,
    check_values_present,
    follow_held_dtype,
    inner_hook_follows,
    make_slot,
    placeholder_state,
    placeholder_states,
)
from .registry import ModelHook, iter_hooks

logger = logging.getLogger(__name__)

_HOOK_DEVICE: Any = object()  # load_value's default: the hook's own execution device


class AlignDevicesHook(ModelHook):
    """Puts a module's inputs, and its weights if ``offload``, on ``execution_device`` for its forward.

    The hook of a block of a device map may also do the work of its submodules' hooks inside the
    block's forward (:meth:`set_members`): one hook runs per block instead of one per submodule.

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
        self.skip_keys = checked_skip_keys(skip_keys)  # refused now, not at every forward
        self.tied_params_map = tied_params_map
        self.input_device: torch.device | None = None
        self.original_devices: dict[str, torch.device] = {}
        self.tied_pointers_to_remove: set[tuple[int, torch.device]] = set()
        self.module_name = ""
        self.prefetcher: Any = None  # set by dispatch.prefetch_setup.enable_prefetch
        self._slots: dict[str, Slot] = {}
        self._kept = KeptValues()  # values put in at an earlier forward, put in again while current (hooks.kept)
        # Offloaded submodules whose weights this hook swaps in and out with its own (see set_members).
        self.members: list[tuple[nn.Module, AlignDevicesHook]] = []
        self._bypassed: list[list[tuple[nn.Module, AlignDevicesHook, Any]]] = []  # per active forward
        self._plans = PlanSlot()  # the members' kept values, put in in one pass (hooks.block_plan)

    _REPR_FIELDS = ("execution_device", "offload", "io_same_device", "offload_buffers", "place_submodules")

    def __repr__(self) -> str:  # as accelerate prints it: settings as str() (execution_device=cpu), skip_keys as repr()
        fields = "".join(f"{name}={getattr(self, name)}, " for name in self._REPR_FIELDS)
        return f"{type(self).__name__}({fields}skip_keys={self.skip_keys!r})"

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
        """Bytes of the offloaded tensors (in the module's dtypes; a wrapper subclass: its inner tensors' bytes)."""
        return sum(
            slot.nbytes if slot.nbytes is not None else slot.placeholder.numel() * slot.placeholder.element_size()
            for slot in self._slots.values()
        )

    @property
    def staged_bytes(self) -> int:
        """Bytes this hook puts in at its forward: its own offloaded tensors and its members'."""
        return sum(hook.offloaded_bytes for hook in self._participants())

    @property
    def swaps_weights(self) -> bool:
        """True if this hook puts offloaded weights in at its forward (its own, or its members')."""
        return self.offload or any(hook.offload for _, hook in self.members)

    def read_values(self) -> dict[str, torch.Tensor]:
        """The values this hook puts in at its forward, read from the weights maps (what a prefetch stages).

        Keys are the tensor names; with members, ``"<id of the hook>|<name>"`` for each hook (its own included).
        """
        if not self.members:
            return read_offloaded(self.weights_map, self._slots) if self.offload else {}  # type: ignore[arg-type]
        values = {}
        for hook in self._participants():
            key = id(hook)
            values.update((f"{key}|{name}", value)
                          for name, value in read_offloaded(hook.weights_map, hook._slots).items())  # type: ignore[arg-type]
        return values

    def _participants(self) -> list[AlignDevicesHook]:
        """The hooks whose offloaded weights this hook puts in: itself (if it offloads) and its offloading members."""
        return ([self] if self.offload else []) + [hook for _, hook in self.members if hook.offload]

    def set_members(self, members: list[tuple[nn.Module, AlignDevicesHook]]) -> None:
        """Do the work of the hooks of ``members`` for them inside this module's forward (see
        :mod:`bigmodel.hooks.members`): one hook run per block instead of one per submodule.

        Args:
            members: ``(submodule, its AlignDevicesHook)`` pairs, each submodule once; the hooks run on
                this hook's execution device.
        """
        self.members = list(members)
        self._plans = PlanSlot()

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
        check_values_present(self, module, [name for name, _ in tensors])  # before any tensor is replaced
        params = {name for name, _ in module.named_parameters(recurse=self.place_submodules)}
        self._kept.clear()
        for name, tensor in tensors:
            self.original_devices[name] = tensor.device
            slot = make_slot(self, name, tensor, name in params)
            self._slots[name] = slot
            assign_tensor(module, name, slot.placeholder)
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
        floating dtype, wrapped as a Parameter (with the placeholder's ``requires_grad``) if it
        was one (ValueError, naming it, if not of its shape).  No copy when it has that device and dtype."""
        slot, device = self._slots[name], self.device if device is _HOOK_DEVICE else device
        return self._as_held(slot, value, device, *placeholder_state(slot), name)

    def slot(self, name: str) -> Slot | None:
        """The :class:`~bigmodel.hooks.placeholders.Slot` of offloaded tensor ``name`` (None if not offloaded)."""
        return self._slots.get(name)

    def _as_held(self, slot: Slot, value: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None,
                 requires_grad: bool, name: str) -> torch.Tensor:
        check_shape(slot, value, name, self.module_name)  # a weights map of another model: named, never broadcast
        if device is not None and value.device != device:
            # Asynchronous only towards an accelerator: a device→host copy must be complete when used.
            value = value.to(device, non_blocking=device.type != "cpu")
        if slot.round_to is not None:
            value = slot.rounded(value)
        if dtype is not None and value.dtype != dtype and value.is_floating_point():
            value = value.to(dtype)
        return slot.wrap(value, requires_grad)

    def stored_value(self, name: str) -> torch.Tensor:
        """A copy of the offloaded value of ``name``: a CPU tensor in the module's dtype, sharing no
        memory with the weights map (changing it never changes the model)."""
        value = self.weights_map[name].detach()  # type: ignore[index]
        if is_tensor_subclass(value):  # its parts copied, the subclass kept (never dequantized)
            parts, spec = flatten_tensor(value, name)
            return unflatten_tensor(spec, {k: v.to("cpu", copy=True) for k, v in parts.items()})
        value = self._slots[name].rounded(value)
        dtype = placeholder_state(self._slots[name])[0] if value.is_floating_point() else None
        return value.to(device="cpu", dtype=dtype or value.dtype, copy=True)

    def load_weights(self, module: nn.Module, values: Mapping[str, torch.Tensor] | None = None) -> None:
        """Put the offloaded values into ``module`` (from ``values`` if given, else the weights map)."""
        values = None if adopt_registered_parameters(self, module) else values
        if not self._slots:
            return
        adopt_replaced_buffers(self._slots, module)
        tokens = token_source(self, values)
        names = put_in_kept(self, module, tokens) if tokens is not None else self._slots
        if not names:
            return
        source = read_offloaded(self.weights_map, names) if values is None else values  # type: ignore[arg-type]
        device = self.device
        tied_map = self.tied_params_map
        for name, slot, dtype, requires_grad in placeholder_states(self._slots, names):
            rebuilt = take_dequantized(self.weights_map, source, name, device)  # type: ignore[arg-type]
            if rebuilt is None and name not in source:
                rebuilt = take_subclass(self.weights_map, source, name, device)  # type: ignore[arg-type]
            value = source[name] if rebuilt is None else rebuilt
            per_device = None
            if tied_map and not value.is_meta and rebuilt is None:  # a tied value is put on a device once
                per_device = tied_map.get(value.data_ptr())
                if per_device is not None and device in per_device:
                    assign_tensor(module, name, per_device[device])
                    continue
            loaded = self._as_held(slot, value, device, dtype, requires_grad, name)
            if tokens is not None and rebuilt is None:
                keep_value(self, tokens, name, slot, value, loaded)
            if per_device is not None:
                per_device[device] = loaded
                self.tied_pointers_to_remove.add((value.data_ptr(), device))
            assign_tensor(module, name, loaded)

    def share_placeholder(self, module: nn.Module, name: str, placeholder: torch.Tensor) -> None:
        """Hold ``placeholder`` for tensor ``name`` between forwards (tied names share one, as they shared
        one Parameter); it must describe the same tensor (its value comes from this hook's weights map)."""
        self._slots[name].placeholder = placeholder
        self._kept.pop(name, None)
        assign_tensor(module, name, placeholder)

    def stop_offloading(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` for ``name`` from now on, in memory, instead of offloading it (a tied name whose
        Parameter another module holds on this hook's execution device: one Parameter, as on the plain model)."""
        del self._slots[name]
        self._kept.pop(name, None)
        self.original_devices.pop(name, None)
        assign_tensor(module, name, tensor)

    def unload_weights(self, module: nn.Module) -> None:
        """Put the meta placeholders back (the values' memory belongs to the weights map again).

        A parameter the forward left in another floating dtype (a layerwise-casting hook of a
        submodule storing it in its storage dtype again after a model-wide ``.to(dtype)``) keeps
        that dtype: its placeholder takes it, as the plain module would keep the Parameter it
        holds.  Not when a hook of this module runs after this one (``runs_innermost``): that hook
        still has the values in hand and sets their dtype itself."""
        if not self._slots and not self.tied_pointers_to_remove:
            return
        follow = not inner_hook_follows(module, self)
        with torch._C.DisableTorchFunctionSubclass():
            for name, slot in self._slots.items():
                if follow and slot.is_parameter and slot.param_type is nn.Parameter:
                    follow_held_dtype(module, name, slot)
                assign_tensor(module, name, slot.placeholder)
        for pointer, device in self.tied_pointers_to_remove:
            self.tied_params_map.get(pointer, {}).pop(device, None)  # type: ignore[union-attr]
        self.tied_pointers_to_remove.clear()

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.io_same_device:
            self.input_device = find_device([args, kwargs])
        prefetcher = self.prefetcher
        if self.offload or self.members:
            # On the CPU each hook reads its own values (the same views; kept ones are not read again, hooks.kept);
            # a quiet forward has nothing staged, nothing to read ahead (Prefetcher.forward_starts).
            busy = prefetcher is not None and not prefetcher.quiet
            staged = prefetcher.take(self, read=False) if busy else None
            if self.members:
                self._load_members(module, staged)
            else:
                self.load_weights(module, staged)
            if busy:
                prefetcher.schedule_after(self)
        elif prefetcher is not None:  # the model's own hook: its forward starts
            prefetcher.forward_starts()
        return send_inputs_to_device(args, kwargs, self.device, self.skip_keys)

    def _load_members(self, module: nn.Module, staged: Mapping[str, torch.Tensor] | None) -> None:
        self._bypassed.append(take_members(self, module, staged))  # members' hooks set aside (see set_members)

    def _unload_members(self) -> None:
        restore_members(self._bypassed.pop() if self._bypassed else ())

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        if self.offload:
            self.unload_weights(module)
        if self.members:
            self._unload_members()
        if self.io_same_device and self.input_device is not None:
            output = send_to_device(output, self.input_device, skip_keys=self.skip_keys)
        return output

    def forward_failed(self, module: nn.Module) -> None:
        """The forward raised: put the meta placeholders back so the loaded weights are freed (the model's
        own hook: its prefetcher forgets a first forward's partial execution order)."""
        if self.offload and self._slots:
            self.unload_weights(module)
        if self.members:
            self._unload_members()
        if not self.offload and not self.members and self.prefetcher is not None:
            self.prefetcher.forward_failed()

    def detach_hook(self, module: nn.Module) -> nn.Module:
        while self._bypassed:  # removed inside its own forward: the members get their hooked forwards back
            self._unload_members()
        self.members = []
        self._plans = PlanSlot()
        if not self.offload:
            return module
        for name, slot, dtype, requires_grad in placeholder_states(self._slots):
            value = self.weights_map[name]  # type: ignore[index]
            original = self.original_devices.get(name)
            device = original if original is not None and original.type != "meta" else None
            assign_tensor(module, name, self._as_held(slot, value, device, dtype, requires_grad, name))
        self._slots.clear()
        self._kept.clear()
        return module


def offload_hook_of(module: nn.Module) -> AlignDevicesHook | None:
    """The offloading AlignDevicesHook of ``module`` (also inside a SequentialHook), or None."""
    for hook in iter_hooks(module.__dict__.get("_hf_hook")):
        if isinstance(hook, AlignDevicesHook) and hook.offload:
            return hook
    return None


def loading_hook_of(module: nn.Module) -> AlignDevicesHook | None:
    """The AlignDevicesHook of ``module`` that puts weights in at its forward (its own, or its members'), or None."""
    for hook in iter_hooks(module.__dict__.get("_hf_hook")):
        if isinstance(hook, AlignDevicesHook) and hook.swaps_weights:
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
