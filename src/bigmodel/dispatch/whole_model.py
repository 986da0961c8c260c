"""Whole-model offload: ``cpu_offload``, ``disk_offload`` and ``cpu_offload_with_hook``.

Also what makes an offload folder hold a model's weights (:func:`ensure_offloaded`): an
existing ``index.json`` entry is reused for a tensor on ``meta`` only when it matches it
(shape, dtype, file present and of the right size), and for a tensor holding real values
only when the stored bytes equal them; the others are written (atomically) from the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..core.devices import DeviceSpec, check_execution_device
from ..core.subclasses import flatten_tensor, is_tensor_subclass
from ..core.tensors import find_tied_parameters
from ..hooks.align import (
    attach_align_device_hook,
    default_execution_device,
    tie_offloaded,
)
from ..hooks.align_hook import AlignDevicesHook
from ..hooks.cpu_offload import CpuOffload, PinnedCpuOffload, UserCpuOffloadHook
from ..hooks.registry import add_hook_to_module
from ..offload.folder_lock import folder_lock
from ..offload.format import folder_path
from ..offload.quantized import check_form
from ..offload.storage import (
    OffloadedWeightsLoader,
    dat_path,
    dtype_name,
    load_offload_index,
    offload_state_dict,
    parse_dtype,
)
from ..offload.subclass_format import is_subclass_entry, part_files, same_form
from ..transfer.pinned import check_pinnable, pin_module_tensors, pin_tensors
from .quantized_offload import quantize_in_ram, store_on_disk, wrap_weights_map
from .redispatch import (
    _enable_prefetch,
    _guard_moves,
    _runs_on_accelerator,
    _undispatch,
    hooks_removed_on_error,
)

logger = logging.getLogger(__name__)


def _entry_problem(entry: Any, tensor: torch.Tensor, folder: Path, name: str) -> str | None:
    """Why ``entry`` of an offload index cannot serve as the value of ``tensor`` (None if it can)."""
    if not isinstance(entry, Mapping):
        return "not in the index"
    try:
        dtype = parse_dtype(entry.get("dtype", ""), name)
    except ValueError:
        return f"unknown dtype {entry.get('dtype')!r}"
    shape = entry.get("shape")
    if shape is not None and list(shape) != list(tensor.shape):
        return f"shape {list(shape)} vs model {list(tensor.shape)}"
    if tensor.device.type != "meta" and dtype != tensor.dtype:
        return f"dtype {dtype_name(dtype)} vs model {dtype_name(tensor.dtype)}"
    if is_subclass_entry(entry) or is_tensor_subclass(tensor):
        return _subclass_problem(entry, tensor, folder, name)
    if "safetensors_file" in entry:
        path = Path(str(entry["safetensors_file"]))
        if not (path if path.is_absolute() else folder / path).is_file():
            return "its safetensors file is missing"
    elif shape is None:
        return "no shape"
    else:
        path = dat_path(folder, name)
        if not path.is_file() or path.stat().st_size != dtype.itemsize * tensor.numel():
            return f"{path.name} is missing or has the wrong size"
    if tensor.device.type != "meta" and not _stores_same_bytes(entry, tensor, folder, name):
        return "it holds other values than the model's"
    return None


def _subclass_problem(entry: Mapping, tensor: torch.Tensor, folder: Path, name: str) -> str | None:
    """:func:`_entry_problem` where the entry or the tensor is a wrapper subclass (stored as its parts)."""
    if not is_subclass_entry(entry):
        return "it holds a plain tensor; the model holds a tensor subclass"
    if tensor.device.type != "meta" and (why := same_form(entry, name, tensor)) is not None:
        return why
    for part, info in part_files(folder, name, entry).values():
        path = dat_path(folder, part)
        need = parse_dtype(info.get("dtype", ""), part).itemsize * torch.Size(info.get("shape", ())).numel()
        if not path.is_file() or path.stat().st_size != need:
            return f"{path.name} is missing or has the wrong size"
    if tensor.device.type != "meta" and not _stores_same_bytes(entry, tensor, folder, name):
        return "it holds other values than the model's"
    return None


def _stores_same_bytes(entry: Mapping, tensor: torch.Tensor, folder: Path, name: str) -> bool:
    """True if the folder's value for ``name`` has exactly ``tensor``'s bytes (read, never written)."""
    try:
        stored = OffloadedWeightsLoader(save_folder=folder, index={name: dict(entry)})[name]
        value = tensor.detach().to("cpu")
        if is_tensor_subclass(value):
            mine, theirs = flatten_tensor(value, name)[0], flatten_tensor(stored, name)[0]
            return mine.keys() == theirs.keys() and all(
                mine[k].shape == theirs[k].shape and mine[k].dtype == theirs[k].dtype
                and torch.equal(_as_bytes(mine[k]), _as_bytes(theirs[k])) for k in mine
            )  # fmt: skip
        if stored.shape != value.shape or stored.dtype != value.dtype:
            return False
        return torch.equal(_as_bytes(stored), _as_bytes(value))
    except (OSError, RuntimeError, ValueError, TypeError):
        return False  # unreadable or not comparable: rewrite it from the model


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def ensure_offloaded(folder: str | os.PathLike, state: Mapping[str, torch.Tensor]) -> None:
    """Make ``folder`` hold every tensor of ``state``.

    An entry of the folder's index is reused for a tensor on ``meta`` (no value of its own) when
    it matches it (shape, dtype, file present and of the right size); for a tensor holding real
    values only when the stored bytes equal them, so a stale folder (another model's, or this
    model's before it changed) never replaces the model's weights.  Every other tensor is
    written (atomically) from the model's values.

    Args:
        folder: the offload folder (created if missing).
        state: state-dict name → tensor (real values, or ``meta`` for values the folder must hold).

    Raises:
        ValueError: such a tensor is on ``meta`` (no value to write); raised before anything is written.
    """
    folder = Path(folder)
    index = load_offload_index(folder) if folder.is_dir() else {}
    problems = {k: _entry_problem(index.get(k), v, folder, k) for k, v in state.items()}
    problems = {k: why for k, why in problems.items() if why is not None}
    if not problems:
        return
    meta = [f"{k} ({problems[k]})" for k in problems if state[k].device.type == "meta"]
    if meta:
        raise ValueError(
            f"{len(meta)} tensor(s) to offload are on the meta device and {str(folder)!r}/index.json cannot "
            f"provide them: {meta[:3]}; load the checkpoint first (load_checkpoint_and_dispatch), or use an "
            "offload folder written for this model."
        )
    if len(problems) < len(state) and index:
        logger.info("Offload folder %s: writing %d tensor(s) its index lacks, describes otherwise or holds "
                    "other values for (e.g. %s).", folder, len(problems), next(iter(problems.items())))
    offload_state_dict(folder, {k: state[k] for k in problems})


def read_by_hooks(model: nn.Module, offload_buffers: bool) -> dict[str, torch.Tensor]:
    """The model's tensors that offloading hooks read from the weights map (by state-dict name)."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if offload_buffers:
        names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if k in names}


def _default_device(model: nn.Module) -> torch.device:
    param = next(iter(model.parameters()), None)
    return param.device if param is not None and param.device.type != "meta" else torch.device("cpu")


def _attach_whole_model(model: nn.Module, execution_device: Any, weights_map: Mapping, offload_buffers: bool,
                        preload_module_classes: list[str] | None) -> None:
    tied = find_tied_parameters(model)
    with hooks_removed_on_error(model):
        add_hook_to_module(model, AlignDevicesHook(io_same_device=True), append=True)
        attach_align_device_hook(
            model, execution_device=execution_device, offload=True, offload_buffers=offload_buffers,
            weights_map=weights_map, preload_module_classes=preload_module_classes,
        )  # fmt: skip
    tie_offloaded(model, tied)
    _enable_prefetch(model, execution_device)
    _guard_moves(model, tied)


def cpu_offload(
    model: nn.Module,
    execution_device: DeviceSpec | None = None,
    offload_buffers: bool = False,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    preload_module_classes: list[str] | None = None,
    offload_quantization: str | None = None,
) -> nn.Module:
    """Keep all of ``model``'s weights on the CPU; each submodule's come to ``execution_device`` for its forward.

    Args:
        model: the model.
        execution_device: where forwards run (default: the device of the model's first parameter).
        offload_buffers: offload buffers too (else they live on ``execution_device``).
        state_dict: the CPU values (default: the model's own, moved to CPU); pinned once when
            ``execution_device`` is an accelerator, and prefetched onto it on a side stream.
        preload_module_classes: class names whose weights are all loaded at the start of their forward.
        offload_quantization: ``"int8"``, ``"int4"`` or ``"float8"``: keep the ``nn.Linear`` weights
            quantized in RAM, dequantized on ``execution_device`` at each forward (see
            :func:`bigmodel.dispatch_model`).

    Returns:
        The model, hooked.

    Raises:
        ValueError: ``execution_device`` is not a device spec (names it and the accepted forms), or
            an unknown ``offload_quantization``.
        TypeError: ``execution_device`` is an accelerator and a weight is a tensor subclass that
            cannot be pinned as plain tensors (names it and the fix; nothing is pinned).
    """
    form = check_form(offload_quantization)
    device = execution_device if execution_device is not None else _default_device(model)
    check_execution_device(device)  # before anything is unhooked
    _undispatch(model, "cpu_offload")
    if _runs_on_accelerator(device):  # refused before anything is pinned
        check_pinnable([*model.state_dict(keep_vars=True).items(), *(state_dict or {}).items()])
    if state_dict is None:
        if _runs_on_accelerator(device):
            pin_module_tensors(model)  # in place, an arena at a time: the model is never in RAM twice
        state_dict = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
    state_dict, in_ram = quantize_in_ram(model, state_dict, form)
    if _runs_on_accelerator(device):
        state_dict = pin_tensors(state_dict, owner=model)  # once; given back when the model is deleted
    weights_map = wrap_weights_map(state_dict, form, in_ram)
    _attach_whole_model(model, device, weights_map, offload_buffers, preload_module_classes)
    return model


def disk_offload(
    model: nn.Module,
    offload_dir: str | os.PathLike,
    execution_device: DeviceSpec | None = None,
    offload_buffers: bool = False,
    preload_module_classes: list[str] | None = None,
    offload_quantization: str | None = None,
) -> nn.Module:
    """Keep all of ``model``'s weights on disk in ``offload_dir``; each submodule's are read for its forward.

    The weights are read from ``offload_dir`` when its ``index.json`` already holds every one of
    them (same shape and dtype, file present); the others are written there first.  A model
    dispatched or offloaded before has its hooks removed first (its weights come back).

    Args:
        model: the model.
        offload_dir: the offload folder.
        execution_device: where forwards run (default: the device of the model's first parameter);
            on an accelerator, weights are read ahead through a pinned staging buffer and copied
            on a side stream.
        offload_buffers: offload buffers too.
        preload_module_classes: class names whose weights are all loaded at the start of their forward.
        offload_quantization: ``"int8"``, ``"int4"`` or ``"float8"``: store the ``nn.Linear`` weights
            in that form in ``offload_dir`` (reused when made from the same bytes), dequantized on
            ``execution_device`` at each forward (see :func:`bigmodel.dispatch_model`).

    Returns:
        The model, hooked.

    Raises:
        ValueError: a weight is on ``meta`` and ``offload_dir`` cannot provide it (before the model is
            changed), or an unknown ``offload_quantization``.
    """
    form = check_form(offload_quantization)
    offload_dir = folder_path(offload_dir, "offload_dir")  # these two before anything is unhooked
    if execution_device is not None:
        check_execution_device(execution_device)
    _undispatch(model, "disk_offload")
    state = {k: v.detach() for k, v in read_by_hooks(model, offload_buffers).items()}
    with folder_lock(offload_dir):  # no other offload writes the folder until its files are mapped
        rest, quantized = store_on_disk(model, offload_dir, state, form)
        ensure_offloaded(offload_dir, rest)
        loader = OffloadedWeightsLoader(save_folder=offload_dir, index=load_offload_index(offload_dir))  # {}: none
        loader.map_dat_files()  # the model keeps its values if another offload rewrites the folder
    device = execution_device if execution_device is not None else _default_device(model)
    weights_map = wrap_weights_map(loader, form, None, offload_dir, quantized)
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
