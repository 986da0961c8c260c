"""Carry out a device map: place each part of a model and attach the hooks that run it.

``dispatch_model`` is the general path (accelerators + CPU + disk); ``load_checkpoint_and_dispatch``
is the one-call path: plan → load → dispatch.  The whole-model shortcuts (``cpu_offload``,
``disk_offload``, ``cpu_offload_with_hook``) live in :mod:`bigmodel.dispatch.whole_model` and are
re-exported here; what a dispatch leaves on a model (move guards, re-dispatch) in
:mod:`bigmodel.dispatch.redispatch`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..core.devices import DeviceSpec, is_accelerator, normalize_device, torch_device
from ..core.tensors import (
    find_tied_parameters,
    name_prefixes,
    retie_parameters,
)
from ..hooks.align import attach_align_device_hook_on_blocks, tie_offloaded, tie_to_resident
from ..hooks.align_hook import offload_hook_of
from ..offload.folder_lock import folder_lock
from ..offload.format import folder_path
from ..offload.quantized import check_form
from ..offload.storage import (
    OffloadedWeightsLoader,
    PrefixedDataset,
    extract_submodules_state_dict,
    load_offload_index,
)
from ..offload.writer import check_writable
from ..transfer.pinned import check_pinnable, pin_module_tensors, pin_tensors
from ..planning.disjoint import disjoint_device_map, module_blocks
from .checkpoint_dispatch import load_checkpoint_and_dispatch
from .quantized_offload import quantize_in_ram, store_on_disk, wrap_weights_map
from .redispatch import (
    _enable_prefetch,
    _guard_moves,
    _is_dispatched,
    _runs_on_accelerator,
    _undispatch,
    hooks_removed_on_error,
)
from .index_gaps import tensor_at, values_the_index_lacks
from .meta_values import refuse_meta_non_persistent, refuse_meta_tensors
from .uncovered import place_uncovered_buffers
from .whole_model import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    ensure_offloaded,
    read_by_hooks,
)

__all__ = [
    "cpu_offload",
    "cpu_offload_with_hook",
    "disk_offload",
    "dispatch_model",
    "get_state_dict_offloaded_model",
    "load_checkpoint_and_dispatch",
]

logger = logging.getLogger(__name__)

# Modules on which callers replace ``check_device_map`` for the duration of a dispatch: code
# ported from the incumbent patches the compatibility module, transformers patches the
# incumbent's ``accelerate.big_modeling`` (use_bigmodel() adds it here while it is on).
# dispatch_model calls the replacement it finds there, the last site first.
CHECK_DEVICE_MAP_SITES: list[str] = ["bigmodel.big_modeling"]


def device_map_checker() -> Callable[[nn.Module, Mapping[str, DeviceSpec]], None]:
    """The ``check_device_map`` dispatch_model calls: a replacement found on a patch site, else bigmodel's."""
    from ..planning.device_map import check_device_map

    for site in reversed(CHECK_DEVICE_MAP_SITES):
        module = sys.modules.get(site)
        replaced = vars(module).get("check_device_map") if module is not None else None
        if replaced is not None and replaced is not check_device_map:
            return replaced
    return check_device_map


def _main_device(device_map: Mapping[str, DeviceSpec]) -> DeviceSpec:
    for device in device_map.values():
        if device not in ("cpu", "disk", "meta") and is_accelerator(device):
            return device
    return "cpu"


def _tied_params_map(model: nn.Module, tied: list[list[str]]) -> dict[int, dict]:
    """``data_ptr → {}`` for the tied tensors (``tied``: :func:`find_tied_parameters`) holding values."""
    pointers: dict[int, dict] = {}
    for group in tied:
        for name in group:
            tensor = tensor_at(model, name)
            if tensor.device.type != "meta":
                pointers[tensor.data_ptr()] = {}
    return pointers


def _resident_groups(model: nn.Module, tied: list[list[str]], device_map: Mapping[str, DeviceSpec]) -> list[list[str]]:
    """The tied groups to tie again after hooking: none of their members offloaded, all on one device.

    Groups whose members are all offloaded share one placeholder (:func:`tie_offloaded`).  In a
    group with offloaded and resident members, the offloaded ones hold the resident Parameter
    when it is on their execution device (:func:`tie_to_resident`: the group is then resident);
    one left on another device keeps its ``meta`` placeholder and loads its value at its forward,
    so ``a.weight is b.weight`` reads the same before and after the first forward (the ties come
    back when the hooks are removed).  A group whose members are mapped to different devices
    (disk aside: its modules run on an execution device) is not tied while dispatched, with a
    warning (as ``load_checkpoint_and_dispatch`` does when it loads one): each member keeps the
    value on its own device, where its module runs.
    """
    offloaded = set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        hook = offload_hook_of(module)
        if hook is not None:
            offloaded.update(f"{prefix}.{name}" if prefix else name for name in hook.offloaded_names)
    resident = []
    for group in tied:
        devices = {_mapped_device(device_map, name) for name in group} - {"disk"}
        if len(devices) > 1:
            logger.warning(
                "Tied parameters %s were mapped to different devices %s; they are no longer tied.", group,
                sorted(devices),
            )
        elif offloaded.isdisjoint(group):
            resident.append(group)
    return resident


def _mapped_device(device_map: Mapping[str, DeviceSpec], name: str) -> str:
    """The device ``name`` is mapped to, as text (``"cuda:1"``, ``"cpu"``, ``"disk"``)."""
    device = next((device_map[p] for p in name_prefixes(name) if p in device_map), "cpu")
    if device in ("cpu", "disk", "meta"):
        return device
    try:
        return str(torch_device(device))
    except ValueError:  # an accelerator index on a machine without one: attaching the hooks says so
        return str(device)


def _disk_weights(
    model: nn.Module, disk_modules: list[str], offload_dir: Any, offload_index: Any, offload_buffers: bool,
    form: str | None = None,
) -> list[str]:
    """Write the disk parts' weights to ``offload_dir``, except those its index already holds.

    Returns:
        The names stored quantized (``form``).
    """
    if not disk_modules or offload_index is not None:
        return []
    state = extract_submodules_state_dict(read_by_hooks(model, offload_buffers), disk_modules)
    rest, quantized = store_on_disk(model, offload_dir, {k: v.detach() for k, v in state.items()}, form)
    ensure_offloaded(offload_dir, rest)
    return quantized


def _check_folder_before_unhooking(model: nn.Module, disk_modules: list[str], offload_dir: Any,
                                   offload_index: Any) -> None:
    """Re-dispatching, check the folder the disk part will be written to before the old hooks come off, so
    that a refused call leaves the dispatched model as it was.  A folder whose index already holds every
    disk parameter is not written to (read-only media work), so it is not checked.

    Raises:
        PermissionError: the folder is a file or cannot be written (see :func:`check_writable`).
    """
    if not disk_modules or offload_index is not None or offload_dir is None or not _is_dispatched(model):
        return
    names = {name for name, _ in model.named_parameters()}
    needed = extract_submodules_state_dict(dict.fromkeys(names), disk_modules)
    folder = os.fspath(offload_dir)
    if set(needed) - set(load_offload_index(folder)):  # {} where there is no index (or no folder)
        check_writable(folder)


def _hooks_offload_folder(model: nn.Module) -> Any:
    """The offload folder the hooks of an earlier dispatch read from (None if there is none)."""
    for module in model.modules():
        hook = offload_hook_of(module)
        weights_map = hook.weights_map if hook is not None else None
        while isinstance(weights_map, PrefixedDataset):
            weights_map = weights_map.dataset
        if isinstance(weights_map, OffloadedWeightsLoader) and weights_map.save_folder is not None:
            return weights_map.save_folder
    return None


def _offload_dir_for(model: nn.Module, disk_modules: list[str], offload_dir: Any, offload_index: Any) -> Any:
    """``offload_dir``, or for a model dispatched before with disk offload, the folder its hooks read from.

    Dispatching again without an offload folder (what peft does after injecting adapters) keeps
    the weights where the existing hooks reach them; tensors the folder lacks are written there.
    """
    if not disk_modules or offload_index is not None or offload_dir is not None:
        return offload_dir if offload_dir is None else folder_path(offload_dir, "offload_dir")
    folder = _hooks_offload_folder(model)
    if folder is None:
        raise ValueError(
            f"The device map puts {disk_modules[:3]} on 'disk' but no offload_dir was given; pass "
            "offload_dir=<folder> (the weights are written there, or read from its index.json)."
        )
    logger.info("dispatch_model: no offload_dir given; using %s, the folder the model's hooks read from.", folder)
    return folder


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
    offload_quantization: str | None = None,
) -> nn.Module:
    """Place each part of ``model`` per ``device_map`` and attach the hooks that run it.

    Args:
        model: the model (its weights loaded, or on ``meta`` for parts whose values are in
            ``state_dict`` / ``offload_dir``).
        device_map: module name → device spec (``""`` is the whole model; ``"cpu"`` and
            ``"disk"`` parts are offloaded when the main device is an accelerator).
        main_device: where offloaded parts run (default: the first accelerator in the map, else cpu).
        state_dict: values of the CPU-offloaded parts (default: taken from the model).
        offload_dir: folder holding (or receiving) the weights of the disk parts.  Optional for a
            model dispatched before with disk offload: the folder its hooks read from is reused.
        offload_index: index of weights already offloaded (name → entry), instead of ``offload_dir``'s.
        offload_buffers: offload buffers too.
        skip_keys: input/output mapping keys never moved.
        preload_module_classes: class names whose weights are all loaded at the start of their forward.
        force_hooks: attach hooks even when the map has a single device.
        offload_quantization: ``"int8"`` (per channel), ``"int4"`` (groups of 64) or ``"float8"``:
            store the offloaded ``nn.Linear`` weights in that form (in RAM for CPU parts, in
            ``offload_dir`` for disk parts, quantized once and reused while the source bytes are
            the same) and dequantize them on the execution device at each forward.  Norms,
            embeddings, biases and tied weights stay in full precision.  None: full precision.

    When the main device is an accelerator, the CPU part's values are pinned once
    (:func:`~bigmodel.transfer.pinned.pin_tensors`; ``BIGMODEL_PIN_MEMORY=0`` opts out) and offloaded
    modules are prefetched onto the device on a side stream, disk values through a bounded pinned
    staging buffer (:class:`~bigmodel.transfer.copies.DeviceStager`).  On the CPU nothing is copied.

    Weights that already are quantized tensor subclasses (torchao's ``Int8Tensor``...) keep that
    form: the hooks move the subclass (its inner tensors, rebuilt on the execution device), and
    ``offload_dir`` stores its inner tensors with a JSON entry (:mod:`bigmodel.offload.subclass_format`).

    Returns:
        The model, with ``model.hf_device_map`` set.

    A model dispatched before has its hooks removed first (its weights come back from the old
    weights map), after the map and ``offload_dir`` are checked: a refused call changes nothing.

    The map is checked by ``check_device_map``, looked up where callers patch it (see
    :data:`CHECK_DEVICE_MAP_SITES`): transformers swaps in a no-op for models whose map
    deliberately leaves some parameters out.

    Raises:
        TypeError: ``device_map`` is not a mapping.
        MetaTensorError: a one-device map (no hooks) would move tensors still on ``meta`` (a
            ``NotImplementedError`` and a ``ValueError``; names them and the fix).
        ValueError: the map does not cover the model, disk parts have no ``offload_dir``, or
            ``offload_dir``'s index lacks (or describes with another shape/dtype) tensors that are
            on ``meta`` in the model.
        TypeError: with an accelerator as main device, a ``"cpu"`` module holds a tensor subclass
            that cannot be pinned as plain tensors (names it and the fix; nothing is changed).
    """
    given, device_map = device_map, disjoint_device_map(model, device_map)  # longest matching key wins
    device_map_checker()(model, given)
    form = check_form(offload_quantization)
    devices = {normalize_device(d) if not isinstance(d, str) or d not in ("cpu", "disk", "meta") else d
               for d in device_map.values()}
    if len(devices) == 1 and not force_hooks and "disk" not in devices:
        _undispatch(model, "dispatch_model")
        refuse_meta_tensors(model, next(iter(device_map.values())))
        model.to(next(iter(device_map.values())))  # a single device: just move the model
        model.hf_device_map = dict(given)
        return model
    main = main_device if main_device is not None else _main_device(device_map)
    if main == "disk":
        raise ValueError("main_device='disk' is not a device a forward can run on; use an accelerator or 'cpu'.")
    cpu_modules = [name for name, d in device_map.items() if d == "cpu"]
    disk_modules = [name for name, d in device_map.items() if d == "disk"]
    offload_dir = _offload_dir_for(model, disk_modules, offload_dir, offload_index)
    on_cpu = not _runs_on_accelerator(main)
    if not on_cpu and cpu_modules:  # refused before anything is unhooked or pinned
        check_pinnable(extract_submodules_state_dict(model.state_dict(keep_vars=True), cpu_modules).items())
    _check_folder_before_unhooking(model, disk_modules, offload_dir, offload_index)
    _undispatch(model, "dispatch_model")
    refuse_meta_non_persistent(model, device_map)
    if not on_cpu and state_dict is None and cpu_modules:
        pin_module_tensors(model, cpu_modules)  # in place, an arena at a time: never two copies in RAM
        state_dict = extract_submodules_state_dict(model.state_dict(), cpu_modules)
    in_ram: dict = {}
    if not on_cpu and state_dict and form is not None:
        state_dict, in_ram = quantize_in_ram(model, state_dict, form)
    if not on_cpu and state_dict:
        state_dict = pin_tensors(state_dict, owner=model)  # once (never the disk part); freed with the model
    tied = find_tied_parameters(model)  # nothing below changes which parameters are tied
    # No other offload writes the folder until this model has mapped its files (map_dat_files).
    with folder_lock(offload_dir if disk_modules else None):
        on_disk = _disk_weights(model, disk_modules, offload_dir, offload_index, offload_buffers, form)
        offloaded_kinds = ("disk",) if on_cpu else ("cpu", "disk")
        blocks, served = module_blocks(model, device_map, offloaded_kinds)  # hooks go on modules
        if served:  # tensors of an offloaded module mapped apart from it: its hook reads them from memory
            tensors = model.state_dict(keep_vars=True)
            state_dict = {**(state_dict or {}), **{name: tensors[name].detach() for name in served}}
        execution_device = {name: main if d in ("cpu", "disk") else d for name, d in blocks.items()}
        execution_device[""] = main
        offload = {name: d in offloaded_kinds for name, d in blocks.items()}
        weights_map = None
        if state_dict is not None or disk_modules or offload_index is not None:
            if disk_modules and offload_index is None:  # the index _disk_weights wrote ({} if it had nothing to write)
                offload_index = load_offload_index(offload_dir)
            in_memory = values_the_index_lacks(model, tied, disk_modules, offload_index or {})
            state_dict = {**(state_dict or {}), **in_memory} if in_memory else state_dict
            weights_map = OffloadedWeightsLoader(
                state_dict=state_dict or {}, save_folder=offload_dir if disk_modules else None, index=offload_index
            )
            weights_map.map_dat_files()  # the model keeps its .dat values if another offload rewrites the folder
            weights_map = wrap_weights_map(weights_map, form, in_ram, offload_dir if on_disk else None, on_disk)
    place_uncovered_buffers(model, device_map, main)
    tied_map = _tied_params_map(model, tied)
    with hooks_removed_on_error(model):
        attach_align_device_hook_on_blocks(
            model, execution_device=execution_device, offload=offload, offload_buffers=offload_buffers,
            weights_map=weights_map, skip_keys=skip_keys, preload_module_classes=preload_module_classes,
            tied_params_map=tied_map,
        )  # fmt: skip
    mixed = tie_offloaded(model, tied)
    tie_to_resident(model, mixed)
    retie_parameters(model, _resident_groups(model, mixed, device_map))
    if any(offload.values()):
        kinds = sorted({d for d in map(str, device_map.values()) if d in offloaded_kinds})
        logger.info("Modules offloaded to %s run on %s.", "/".join(kinds), main)
        _enable_prefetch(model, main)
    _guard_moves(model, tied)
    model.hf_device_map = dict(given)
    return model


def get_state_dict_offloaded_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a dispatched model on CPU, offloaded weights included.

    Args:
        model: a model dispatched with :func:`dispatch_model` (or offloaded).

    Returns:
        name → CPU tensor, in ``model.state_dict()`` order.  Offloaded values are copies read
        from their weights map, in the model's dtype (changing them never changes the model);
        tensors the model holds on the CPU are its own, as in ``model.state_dict()``, and those
        on an accelerator are copied to the CPU.
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
