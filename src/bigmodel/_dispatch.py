"""Carry out a device map: place each part of a model and attach the hooks that run it.

``dispatch_model`` is the general path (accelerators + CPU + disk); ``cpu_offload`` and
``disk_offload`` are the two whole-model offload shortcuts; ``cpu_offload_with_hook`` moves
whole models in and out of the device (pipelines of models); ``load_checkpoint_and_dispatch``
is the one-call path: plan → load → dispatch.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._align import (
    CpuOffload,
    UserCpuOffloadHook,
    attach_align_device_hook,
    attach_align_device_hook_on_blocks,
    default_execution_device,
)
from ._align_hook import AlignDevicesHook, has_offloaded_params, offload_hook_of
from ._devices import DeviceSpec, is_accelerator, normalize_device
from ._hook_registry import TIED_PARAMS, add_hook_to_module, patch_attribute
from ._moving import send_to_device
from ._offload import OffloadedWeightsLoader, extract_submodules_state_dict, load_offload_index, offload_state_dict
from ._pinned import pin_tensors
from ._prefetch import enable_prefetch
from ._tensors import find_tied_parameters, get_submodule_and_name, retie_parameters
from ._transfer import CopyStream, DeviceStager

logger = logging.getLogger(__name__)

# Methods that move or cast a whole model; on a model with offloaded parts they are refused.
_MOVE_METHODS = ("to", "cuda", "cpu", "xpu", "npu", "mps", "half", "float", "double", "bfloat16", "type")


def _offloaded_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if has_offloaded_params(module)]


def _guarded_method(ref: weakref.ref, name: str, method: Callable) -> Callable:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        model = ref()
        offloaded = _offloaded_names(model)
        if offloaded:
            shown = ", ".join(repr(n) for n in offloaded[:3]) + (" ..." if len(offloaded) > 3 else "")
            raise RuntimeError(
                f"Cannot call .{name}() on a {type(model).__name__} dispatched with offloaded modules ({shown}): "
                "their weights live in the weights map (CPU/disk) and would not follow. Dispatch it again with "
                "another device map (or dtype), or call bigmodel.remove_hook_from_submodules(model) first, "
                "which brings the weights back into the modules."
            )
        logger.warning(
            "Calling .%s() on a model dispatched over several devices moves every part; its hooks keep the old "
            "execution devices. Re-dispatch the model instead.", name,
        )
        return method(model, *args, **kwargs)

    guarded.__name__ = name
    return guarded


def _guard_moves(model: nn.Module, tied: list[list[str]]) -> None:
    """Refuse .to()/.half()/... on the model while parts are offloaded; remember its ties for removal."""
    patch_attribute(model, TIED_PARAMS, tied)
    ref = weakref.ref(model)
    for name in _MOVE_METHODS:
        method = getattr(type(model), name, None)
        if callable(method):
            patch_attribute(model, name, _guarded_method(ref, name, method))


def _runs_on_accelerator(device: DeviceSpec | None) -> bool:
    """True when forwards run on an accelerator: CPU-held weights are then pinned once, and
    offloaded values reach the device through :class:`~bigmodel._transfer.DeviceStager`
    (side-stream copies; disk values through its pinned staging buffer)."""
    return device is not None and device != "disk" and is_accelerator(device)


def _enable_prefetch(model: nn.Module, device: DeviceSpec) -> None:
    """Prefetch for ``model``'s offloading hooks, staging to the device when it is an accelerator."""
    enable_prefetch(model, stage=DeviceStager() if _runs_on_accelerator(device) else None)


def _main_device(device_map: Mapping[str, DeviceSpec]) -> DeviceSpec:
    for device in device_map.values():
        if device not in ("cpu", "disk", "meta") and is_accelerator(device):
            return device
    return "cpu"


def _tied_params_map(model: nn.Module) -> tuple[list[list[str]], dict[int, dict]]:
    tied = find_tied_parameters(model)
    pointers: dict[int, dict] = {}
    for group in tied:
        for name in group:
            sub, attr = get_submodule_and_name(model, name)
            tensor = getattr(sub, attr)
            if tensor.device.type != "meta":
                pointers[tensor.data_ptr()] = {}
    return tied, pointers


def _disk_weights(
    model: nn.Module, disk_modules: list[str], offload_dir: Any, offload_index: Any, offload_buffers: bool
) -> None:
    """Write the disk parts' weights to ``offload_dir``, except those its index already holds."""
    if not disk_modules or offload_index is not None:
        return
    if offload_dir is None:
        raise ValueError(
            f"The device map puts {disk_modules[:3]} on 'disk' but no offload_dir was given; pass "
            "offload_dir=<folder> (the weights are written there, or read from its index.json)."
        )
    index = load_offload_index(offload_dir) if Path(offload_dir).is_dir() else {}
    read_by_hooks = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if offload_buffers:
        read_by_hooks.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    state = extract_submodules_state_dict(
        {k: v for k, v in model.state_dict().items() if k in read_by_hooks}, disk_modules
    )
    missing = {k: v for k, v in state.items() if k not in index}
    if missing:
        meta = [k for k, v in missing.items() if v.device.type == "meta"]
        if meta:
            raise ValueError(
                f"{len(meta)} tensors mapped to disk ({meta[:3]}) are on the meta device and not in "
                f"{str(offload_dir)!r}/index.json; load the checkpoint first (load_checkpoint_and_dispatch)."
            )
        offload_state_dict(offload_dir, missing)


def dispatch_model(
    model: nn.Module,
    device_map: Mapping[str, DeviceSpec],
    main_device: DeviceSpec | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    offload_dir: str | os.PathLike | None = None,
    offload_index: Mapping[str, dict] | None = None,
    offload_buffers: bool = False,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    force_hooks: bool = False,
) -> nn.Module:
    """Place each part of ``model`` per ``device_map`` and attach the hooks that run it.

    Args:
        model: the model (its weights loaded, or on ``meta`` for parts whose values are in
            ``state_dict`` / ``offload_dir``).
        device_map: module name → device spec (``""`` is the whole model; ``"cpu"`` and
            ``"disk"`` parts are offloaded when the main device is an accelerator).
        main_device: where offloaded parts run (default: the first accelerator in the map, else cpu).
        state_dict: values of the CPU-offloaded parts (default: taken from the model).
        offload_dir: folder holding (or receiving) the weights of the disk parts.
        offload_index: index of weights already offloaded (name → entry), instead of ``offload_dir``'s.
        offload_buffers: offload buffers too.
        skip_keys: input/output mapping keys never moved.
        preload_module_classes: class names whose weights are all loaded at the start of their forward.
        force_hooks: attach hooks even when the map has a single device.

    When the main device is an accelerator, the CPU part's values are pinned once
    (:func:`~bigmodel._pinned.pin_tensors`; ``BIGMODEL_PIN_MEMORY=0`` opts out) and offloaded
    modules are prefetched onto the device on a side stream, disk values through a bounded pinned
    staging buffer (:class:`~bigmodel._transfer.DeviceStager`).  On the CPU nothing is copied.

    Returns:
        The model, with ``model.hf_device_map`` set.

    Raises:
        ValueError: the map does not cover the model, or disk parts have no ``offload_dir``.
    """
    from ._planning import check_device_map

    check_device_map(model, device_map)
    devices = {normalize_device(d) if not isinstance(d, str) or d not in ("cpu", "disk", "meta") else d
               for d in device_map.values()}
    if len(devices) == 1 and not force_hooks and "disk" not in devices:
        model.to(next(iter(device_map.values())))  # a single device: just move the model
        model.hf_device_map = dict(device_map)
        return model
    main = main_device if main_device is not None else _main_device(device_map)
    if main == "disk":
        raise ValueError("main_device='disk' is not a device a forward can run on; use an accelerator or 'cpu'.")
    cpu_modules = [name for name, d in device_map.items() if d == "cpu"]
    disk_modules = [name for name, d in device_map.items() if d == "disk"]
    on_cpu = not _runs_on_accelerator(main)
    if not on_cpu and state_dict is None and cpu_modules:
        state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    if not on_cpu and state_dict:
        state_dict = pin_tensors(state_dict)  # once, for asynchronous copies (never the disk part)
    _disk_weights(model, disk_modules, offload_dir, offload_index, offload_buffers)
    offloaded_kinds = ("disk",) if on_cpu else ("cpu", "disk")
    execution_device = {name: main if d in ("cpu", "disk") else d for name, d in device_map.items()}
    execution_device[""] = main
    offload = {name: d in offloaded_kinds for name, d in device_map.items()}
    weights_map = None
    if state_dict is not None or disk_modules or offload_index is not None:
        weights_map = OffloadedWeightsLoader(
            state_dict=state_dict or {}, save_folder=offload_dir if disk_modules else None, index=offload_index
        )
    tied, tied_map = _tied_params_map(model)
    attach_align_device_hook_on_blocks(
        model, execution_device=execution_device, offload=offload, offload_buffers=offload_buffers,
        weights_map=weights_map, skip_keys=skip_keys, preload_module_classes=preload_module_classes,
        tied_params_map=tied_map,
    )  # fmt: skip
    retie_parameters(model, tied)
    if any(offload.values()):
        logger.info("Modules offloaded to %s run on %s.", "/".join(sorted({d for d in map(str, device_map.values()) if d in offloaded_kinds})), main)
        _enable_prefetch(model, main)
    _guard_moves(model, tied)
    model.hf_device_map = dict(device_map)
    return model


def _default_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None and param.device.type != "meta" else torch.device("cpu")


def _attach_whole_model(model: nn.Module, execution_device: Any, weights_map: Mapping, offload_buffers: bool,
                        preload_module_classes: list[str] | None) -> None:
    tied = find_tied_parameters(model)
    add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
    attach_align_device_hook(
        model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
        weights_map=weights_map, preload_module_classes=preload_module_classes,
    )  # fmt: skip
    _enable_prefetch(model, execution_device)
    _guard_moves(model, tied)


def cpu_offload(
    model: nn.Module,
    execution_device: DeviceSpec | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep all of ``model``'s weights on the CPU; each submodule's come to ``execution_device`` for its forward.

    Args:
        model: the model.
        execution_device: where forwards run (default: the device of the model's first parameter).
        offload_buffers: offload buffers too (else they live on ``execution_device``).
        state_dict: the CPU values (default: the model's own, moved to CPU); pinned once when
            ``execution_device`` is an accelerator, and prefetched onto it on a side stream.
        preload_module_classes: class names whose weights are all loaded at the start of their forward.

    Returns:
        The model, hooked.
    """
    device = execution_device if execution_device is not None else _default_device(model)
    if state_dict is None:
        state_dict = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
    if _runs_on_accelerator(device):
        state_dict = pin_tensors(state_dict)  # once, for asynchronous copies to the device
    _attach_whole_model(model, device, state_dict, offload_buffers, preload_module_classes)
    return model


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: DeviceSpec | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
) -> nn.Module:
    """Keep all of ``model``'s weights on disk in ``offload_dir``; each submodule's are read for its forward.

    The weights are written to ``offload_dir`` unless it already holds an ``index.json``.

    Args:
        model: the model.
        offload_dir: the offload folder.
        execution_device: where forwards run (default: the device of the model's first parameter);
            on an accelerator, weights are read ahead through a pinned staging buffer and copied
            on a side stream.
        offload_buffers: offload buffers too.
        preload_module_classes: class names whose weights are all loaded at the start of their forward.

    Returns:
        The model, hooked.
    """
    if not (Path(offload_dir) / "index.json").is_file():
        offload_state_dict(offload_dir, model.state_dict())
    device = execution_device if execution_device is not None else _default_device(model)
    weights_map = OffloadedWeightsLoader(save_folder=offload_dir)
    _attach_whole_model(model, device, weights_map, offload_buffers, preload_module_classes)
    return model


def cpu_offload_with_hook(
    model: nn.Module,
    execution_device: DeviceSpec | None = None,
    prev_module_hook: UserCpuOffloadHook | None = None,
) -> tuple[nn.Module, UserCpuOffloadHook]:
    """Move the whole model to ``execution_device`` at its forward and keep it there until offloaded.

    Args:
        model: the model (moved to the CPU now).
        execution_device: where the forward runs (default: the first accelerator, else the CPU);
            on an accelerator the CPU copy is pinned once (:class:`PinnedCpuOffload`).
        prev_module_hook: the hook of the model that runs before this one; it is offloaded when
            this model's forward starts.

    Returns:
        ``(model, hook)``; ``hook.offload()`` sends the model back to the CPU.
    """
    device = execution_device if execution_device is not None else default_execution_device()
    hook_class = PinnedCpuOffload if _runs_on_accelerator(device) else CpuOffload
    hook = hook_class(execution_device=device, prev_module_hook=prev_module_hook)
    add_hook_to_module(model, hook, append=True)
    return model, UserCpuOffloadHook(model, hook)


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*module.named_parameters(), *module.named_buffers()])


class PinnedCpuOffload(CpuOffload):
    """:class:`CpuOffload` towards an accelerator: the CPU copy of the model is pinned once and reused.

    Offloading copies the device values back into the same pinned tensors (changes made on the
    device are kept); the forward's move to the device is a side-stream copy from pinned memory
    (:class:`~bigmodel._transfer.CopyStream`) that the device's current stream waits for.  The
    pinned copy stays allocated while the model is on the device (``BIGMODEL_PIN_MEMORY=0``
    turns pinning off; the CPU copy is then pageable but still kept).
    """

    def __init__(self, execution_device: Any = None, prev_module_hook: UserCpuOffloadHook | None = None) -> None:
        super().__init__(execution_device, prev_module_hook)
        self._host: dict[str, torch.Tensor] = {}
        self._copies: CopyStream | None = None

    def init_hook(self, module: nn.Module) -> nn.Module:  # also what UserCpuOffloadHook.offload() runs
        tensors = _own_tensors(module)
        if set(tensors) != set(self._host):  # first call, or the module gained/lost tensors
            module.to("cpu")
            tensors = _own_tensors(module)
            self._host = pin_tensors({name: t.detach() for name, t in tensors.items()})
            for name, tensor in tensors.items():
                tensor.data = self._host[name]
            return module
        for name, tensor in tensors.items():
            host = self._host[name]
            if tensor.data_ptr() != host.data_ptr():
                host.copy_(tensor.detach())  # device → pinned host (blocking): changes made on the device stay
                tensor.data = host
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        if self.prev_module_hook is not None:
            self.prev_module_hook.offload()
        if self._copies is None:
            self._copies = CopyStream(self.execution_device)
        device = self._copies.device
        tensors = _own_tensors(module)
        moved = self._copies.copy({n: t.detach() for n, t in tensors.items() if t.device != device}).wait()
        for name, value in moved.items():
            tensors[name].data = value
        return send_to_device(args, device), send_to_device(kwargs, device)


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
        skip_keys, preload_module_classes, force_hooks: as in :func:`dispatch_model`.

    Returns:
        The model, loaded and dispatched.

    Raises:
        ValueError: an unknown string map (lists the accepted ones), or disk parts without ``offload_folder``.
    """
    from ._loading import load_checkpoint_in_model
    from ._planning import resolve_device_map

    if no_split_module_classes is None:
        no_split_module_classes = list(getattr(model, "_no_split_modules", None) or []) or None
    if isinstance(device_map, str):
        device_map = resolve_device_map(
            model, device_map, max_memory, no_split_module_classes, dtype, offload_buffers=offload_buffers
        )
    if offload_state_dict is None:
        offload_state_dict = device_map is not None and "disk" in device_map.values()
    load_checkpoint_in_model(
        model, checkpoint, device_map=device_map, offload_folder=offload_folder, dtype=dtype,
        offload_state_dict=offload_state_dict, offload_buffers=offload_buffers, strict=strict,
        full_state_dict=full_state_dict, broadcast_from_rank0=broadcast_from_rank0,
    )  # fmt: skip
    if device_map is None:
        return model
    return dispatch_model(
        model, device_map=device_map, offload_dir=offload_folder, offload_buffers=offload_buffers,
        skip_keys=skip_keys, preload_module_classes=preload_module_classes, force_hooks=force_hooks,
    )  # fmt: skip


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a dispatched model on CPU, offloaded weights included.

    Args:
        model: a model dispatched with :func:`dispatch_model` (or offloaded).

    Returns:
        name → CPU tensor, in ``model.state_dict()`` order (offloaded values are read from
        their weights map, in the model's dtype).
    """
    offloaded: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        hook = offload_hook_of(module)
        if hook is None:
            continue
        for name in hook.offloaded_names:
            offloaded[f"{prefix}.{name}" if prefix else name] = hook.stored_value(name)
    return {
        name: offloaded[name] if name in offloaded else tensor.detach().to("cpu")
        for name, tensor in model.state_dict(keep_vars=True).items()
    }
