"""``load_checkpoint_in_model``: stream a checkpoint straight onto the devices of a device map.

The load runs in three steps:

1. *plan* (nothing touched yet): resolve the files, read every tensor's dtype and shape
   from the headers, compare them with the model (missing/unexpected keys, shapes), and
   decide each tensor's device and dtype;
2. *stream*: read the checkpoint one tensor at a time; each goes to its device (a
   zero-copy view on CPU when its dtype is unchanged) or to the offload folder (a pointer
   into the safetensors file when possible, else a ``.dat`` file);
3. *commit*: write the offload index atomically and re-tie tied parameters.

:func:`load_converted_checkpoint` does the same for a checkpoint whose keys are not the
model's names (a :class:`bigmodel.loading.conversion.KeyConversion` maps them).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..checkpoints.files import (
    TensorInfo,
    iter_checkpoint_tensors,
    read_tensor_infos,
    resolve_checkpoint_files,
)
from ..checkpoints.gguf import GGUFCheckpoint, is_gguf
from ..core.coverage import check_covered
from ..core.devices import DeviceSpec
from ..core.progress import ByteProgress
from ..core.sizes import floating_dtype
from ..core.tensors import (
    device_of,
    find_tied_parameters,
    hold_meta_placeholder,
    loaded_dtype,
    retie_parameters,
    set_module_tensor_to_device,
)
from ..offload.folder_lock import folder_lock
from ..offload.format import files_no_offload_wrote, folder_path
from ..offload.quantized import check_form, quantizable_names
from ..offload.quantized_store import QuantizedFolderWrites
from ..offload.storage import OffloadWriter
from .conversion import KeyConversion, TensorRouter, convert_infos
from .key_checks import check_shapes, listed, note_filled, placeable_device, report_keys, warn_meta_non_persistent
from .resident import bring_back, read_whole_pickles, unmapped

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Target:
    """Where one model tensor goes: ``device`` (``"disk"`` included), the dtype to store it in, and
    the dtype the model computes with (for ``"disk"``: the dtype of its ``meta`` placeholder)."""

    device: torch.device | str  # "disk" or a torch device
    dtype: torch.dtype
    held_dtype: torch.dtype


@dataclass
class _Plan:
    infos: dict[str, TensorInfo]  # model tensor name → what fills it
    targets: dict[str, _Target]
    aliases: dict[str, list[str]] = field(default_factory=dict)  # model name → tied names it also fills
    tied_groups: list[list[str]] = field(default_factory=list)
    loaded: dict[Path, dict[str, torch.Tensor]] = field(default_factory=dict)  # mapped pickles, read once
    router: TensorRouter = field(default_factory=lambda: TensorRouter(None))  # checkpoint key → model names
    read_bytes: int = 0  # bytes of the checkpoint tensors read
    placeholders: dict[int, torch.Tensor] = field(default_factory=dict)  # model tensor id → its meta placeholder
    source: GGUFCheckpoint | None = None  # its own names, infos and dequantized tensors
    quantized: QuantizedFolderWrites | None = None  # disk weights stored quantized
    sources: dict[str, Path] = field(default_factory=dict)  # checkpoint key → the file it is read from


def load_checkpoint_in_model(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    device_map: Mapping[str, DeviceSpec] | None = None,
    offload_folder: str | os.PathLike | None = None,
    dtype: torch.dtype | str | None = None,
    offload_state_dict: bool = False,
    offload_buffers: bool = False,
    keep_in_fp32_modules: Sequence[str] | None = None,
    offload_8bit_bnb: bool = False,
    strict: bool = False,
    full_state_dict: bool = True,
    broadcast_from_rank0: bool = False,
    offload_quantization: str | None = None,
) -> None:
    """Load a checkpoint into ``model``, each tensor straight onto the device the map gives it.

    Args:
        model: the model, usually built under :func:`bigmodel.init_empty_weights`.
        checkpoint: a weights file, a sharded checkpoint's ``.json`` index (with a
            ``weight_map``, or a plain tensor name → shard file mapping), or a folder holding
            one of them (a Hugging Face hub cache snapshot folder included).
        device_map: module/tensor name → device (``"disk"`` → ``offload_folder``).  Without a
            map, each tensor goes to the device of the model's tensor (CPU for ``meta``).
            Tensors placed in memory take the model's floating dtype (or ``dtype``); tensors
            mapped to disk keep the checkpoint's, cast when the offload hook loads them.
            CPU tensors of safetensors files are zero-copy views, protected against the files
            being rewritten (:mod:`bigmodel.core.file_maps`); those of pickles are copies.
        offload_folder: where ``"disk"`` tensors go (``index.json`` + ``.dat`` files, or
            pointers into the safetensors checkpoint when the dtype is unchanged).  It may be
            the checkpoint's own folder: the offload files are added there, and a file that
            no offload wrote (the checkpoint's, a user's ``index.json``) is never overwritten.
        dtype: dtype for floating tensors (int/bool keep theirs).
        offload_state_dict: spill CPU tensors that need a cast to a temporary folder while
            loading and map them back at the end (caps anonymous RAM to about one tensor).
        offload_buffers: also put buffers mapped to ``"disk"`` on disk (by default they go to CPU).
        keep_in_fp32_modules: module names (a name segment or a dotted prefix) whose floating
            tensors stay float32.
        offload_8bit_bnb: accepted for compatibility; bitsandbytes weights are stored as they are.
        strict: raise on missing or unexpected keys instead of logging them.
        full_state_dict: with ``broadcast_from_rank0``, gather loaded values (else keep them sharded).
        broadcast_from_rank0: read on rank 0 and broadcast to the other ranks.
        offload_quantization: ``"int8"``, ``"int4"`` or ``"float8"``: store the ``nn.Linear`` weights
            mapped to ``"disk"`` so, reusing the folder's entries made from the same bytes in that form.

    Raises:
        FileNotFoundError: the checkpoint or one of its shards is missing.
        ValueError: corrupted checkpoint, shape mismatch (names the key and both shapes),
            ``"disk"`` in the map without ``offload_folder``, an offload into the checkpoint's
            folder that would overwrite a file no offload wrote (names it), missing/unexpected
            keys with ``strict=True``.  All of these are raised before the model is modified.
        PermissionError: the offload folder is not writable.
    """
    load_filling(
        model, checkpoint, device_map, offload_folder, dtype, offload_state_dict, offload_buffers,
        keep_in_fp32_modules, offload_8bit_bnb, strict, full_state_dict, broadcast_from_rank0, offload_quantization,
    )  # fmt: skip


def load_filling(
    model: nn.Module, checkpoint: str | os.PathLike, device_map: Mapping[str, DeviceSpec] | None,
    offload_folder: str | os.PathLike | None, dtype: torch.dtype | str | None, offload_state_dict: bool,
    offload_buffers: bool, keep_in_fp32_modules: Sequence[str] | None, offload_8bit_bnb: bool, strict: bool,
    full_state_dict: bool, broadcast_from_rank0: bool, offload_quantization: str | None,
) -> set[str] | None:  # fmt: skip
    """:func:`load_checkpoint_in_model` (same arguments), returning the names of the model tensors this
    load and earlier loads of the model with ``offload_folder`` filled (None for ``broadcast_from_rank0``)."""
    if broadcast_from_rank0:
        from .distributed import load_checkpoint_broadcast

        return load_checkpoint_broadcast(
            model, checkpoint, device_map=device_map, dtype=dtype,
            keep_in_fp32_modules=keep_in_fp32_modules, strict=strict, full_state_dict=full_state_dict,
        )  # fmt: skip
    if offload_8bit_bnb:
        logger.debug("offload_8bit_bnb: bitsandbytes weights are offloaded as stored.")
    with folder_lock(offload_folder):  # no other offload into the folder meanwhile
        return _load(
            model, checkpoint, None, device_map, offload_folder, floating_dtype(dtype), offload_state_dict,
            offload_buffers, keep_in_fp32_modules or (), strict, check_form(offload_quantization),
        )  # fmt: skip


def _load(
    model: nn.Module,
    checkpoint: str | os.PathLike,
    conversion: KeyConversion | None,
    device_map: Mapping[str, DeviceSpec] | None,
    offload_folder: str | os.PathLike | None,
    dtype: torch.dtype | None,
    offload_state_dict: bool,
    offload_buffers: bool,
    fp32: Sequence[str],
    strict: bool,
    form: str | None = None,
) -> set[str]:
    source = GGUFCheckpoint(checkpoint, model) if is_gguf(checkpoint) else None
    files = [source.path] if source is not None else resolve_checkpoint_files(checkpoint)
    plan = _make_plan(model, files, conversion, device_map, dtype, fp32, strict, offload_buffers, source)
    writer = _disk_writer(plan, offload_folder, files, checkpoint)
    if writer is not None and form is not None:
        plan.quantized = QuantizedFolderWrites(writer, quantizable_names(model, form), form)
    spill = OffloadWriter(tempfile.mkdtemp(prefix="bigmodel-spill-")) if offload_state_dict else None
    try:
        _stream(model, files, plan, writer, spill)
        if writer is not None:
            writer.commit()
        if spill is not None:
            spill.commit()
            bring_back(model, spill)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if spill is not None:
            shutil.rmtree(spill.folder, ignore_errors=True)
    _retie(model, plan)
    return note_filled(model, offload_folder, plan.targets)


# ---------------------------------------------------------------- planning (nothing modified)


def _make_plan(
    model: nn.Module,
    files: list[Path],
    conversion: KeyConversion | None,
    device_map: Mapping[str, DeviceSpec] | None,
    dtype: torch.dtype | None,
    keep_in_fp32: Sequence[str],
    strict: bool,
    offload_buffers: bool,
    source: GGUFCheckpoint | None = None,
) -> _Plan:
    loaded: dict[Path, dict[str, torch.Tensor]] = {}
    stored = source.infos() if source is not None else read_tensor_infos(files, keep_loaded=loaded)
    converted = convert_infos(stored, conversion)
    infos = converted.infos
    expected = model.state_dict(keep_vars=True)
    buffers = {name for name, _ in model.named_buffers()}
    plan = _Plan(
        infos=infos, targets={}, tied_groups=find_tied_parameters(model), loaded=loaded,
        router=TensorRouter(conversion, converted.shadowed), source=source,
        read_bytes=sum(i.dtype.itemsize * torch.Size(i.shape).numel() for i in stored.values()),
        sources={key: info.file for key, info in stored.items()},
    )  # fmt: skip
    for group in plan.tied_groups:
        present = [n for n in group if n in infos]
        absent = [n for n in group if n not in infos and n in expected]
        if present and absent:
            plan.aliases.setdefault(present[0], []).extend(absent)
    filled = {n for names in plan.aliases.values() for n in names}
    missing = sorted(set(expected) - set(infos) - filled)
    unexpected = sorted(set(infos) - set(expected))
    report_keys(missing, unexpected, strict)
    warn_meta_non_persistent(model)
    check_shapes(expected, infos, plan.aliases)
    sourced = {name: infos.get(name) or next((infos[k] for k, v in plan.aliases.items() if name in v), None)
               for name in expected}
    sourced = {name: source for name, source in sourced.items() if source is not None}
    if device_map is not None:  # every tensor to place is named at once, before anything is placed
        check_covered(sourced, device_map, type(model).__name__)
    for name, source in sourced.items():
        tensor = expected[name]
        device = _device_for(name, tensor, device_map, buffers, offload_buffers)
        held = _dtype_for(name, tensor, source, "memory", dtype, keep_in_fp32)
        stored = held if device != "disk" else _dtype_for(name, tensor, source, device, dtype, keep_in_fp32)
        plan.targets[name] = _Target(device, stored, held)
    return plan


def _device_for(
    name: str,
    tensor: torch.Tensor,
    device_map: Mapping[str, DeviceSpec] | None,
    buffers: set[str],
    offload_buffers: bool,
) -> torch.device | str:
    if device_map is None:
        return torch.device("cpu") if tensor.device.type == "meta" else tensor.device
    device = device_of(name, device_map)
    if device == "disk":
        return torch.device("cpu") if name in buffers and not offload_buffers else "disk"
    return placeable_device(name, device)  # ValueError naming a bad or absent device, before anything is placed


def _dtype_for(
    name: str,
    tensor: torch.Tensor,
    source: TensorInfo,
    device: object,
    dtype: torch.dtype | None,
    keep_in_fp32: Sequence[str],
) -> torch.dtype:
    """The dtype a tensor is stored in (see :func:`bigmodel.core.tensors.loaded_dtype`).

    Tensors placed in memory take the model's floating dtype, as ``set_module_tensor_to_device``
    does; tensors mapped to disk keep the checkpoint's (so a safetensors file is used in place),
    and the offload hook casts them to the model's dtype when it loads them for a forward.
    """
    return loaded_dtype(
        name, source.dtype, tensor, dtype=dtype, keep_in_fp32=keep_in_fp32, use_model_dtype=device != "disk"
    )


def _disk_writer(
    plan: _Plan, offload_folder: str | os.PathLike | None, files: list[Path], checkpoint: str | os.PathLike
) -> OffloadWriter | None:
    disk = sorted(n for n, t in plan.targets.items() if t.device == "disk")
    if not disk:
        return None
    if offload_folder is None:
        raise ValueError(
            f"The device map puts {len(disk)} tensor(s) on 'disk' ({listed(disk)}) but no offload_folder was "
            "given; pass offload_folder=<a writable folder>."
        )
    folder = folder_path(offload_folder).resolve()
    source = Path(checkpoint).resolve()
    if folder in {f.parent for f in files} | {source if source.is_dir() else source.parent}:
        foreign = files_no_offload_wrote(folder, disk)
        if foreign:
            raise ValueError(
                f"offload_folder {str(folder)!r} is the checkpoint's folder, and {foreign[0].name!r} already exists "
                "in the checkpoint's folder: bigmodel adds its offload files (index.json, <tensor>.dat, and "
                "<tensor>#<part>.dat or <tensor>@<part>.dat for a tensor stored in parts) there but never overwrites "
                "a file it did not write; pass another offload_folder."
            )
    return OffloadWriter(folder)


# ---------------------------------------------------------------- streaming


def _stream(
    model: nn.Module, files: list[Path], plan: _Plan, writer: OffloadWriter | None, spill: OffloadWriter | None
) -> None:
    """Read the checkpoint tensor by tensor and send each to its device, the offload folder or the spill."""
    read_whole_pickles(plan.infos, plan.targets, plan.loaded, capped=spill is not None)
    with ByteProgress(plan.read_bytes, "Loading checkpoint") as bar:
        if plan.source is not None:
            tensors = plan.source.tensors()
        else:
            tensors = iter_checkpoint_tensors(files, plan.loaded, plan.sources)
        for key, stored in tensors:
            for model_name, tensor, source_key in plan.router.route(key, stored):
                _place(model, model_name, tensor, source_key, plan, writer, spill)
            bar.update(stored.nbytes)
    unfinished = plan.router.unfinished()
    if unfinished:  # cannot happen for a checkpoint read whole; guards a reader that skipped tensors
        raise RuntimeError(f"Tensor conversions never received all their sources, e.g. {unfinished[0]!r}.")


def _place(
    model: nn.Module,
    model_name: str,
    tensor: torch.Tensor,
    source_key: str | None,
    plan: _Plan,
    writer: OffloadWriter | None,
    spill: OffloadWriter | None,
) -> None:
    """Send one model tensor (and the tied names it also fills) to its device, the folder or the spill."""
    first: str | None = None
    names = (model_name, *plan.aliases.get(model_name, ()))
    resident = unmapped(tensor, plan.infos[model_name], [plan.targets.get(n) for n in names])
    for name in names:
        target = plan.targets.get(name)
        if target is None:
            continue
        if target.device == "disk" and plan.quantized is not None and name in plan.quantized:
            plan.quantized.write(name, tensor.to(target.dtype))
        elif target.device == "disk":
            _to_folder(writer, name, source_key, tensor, plan.infos[model_name], target, first)
            hold_meta_placeholder(model, name, target.held_dtype, plan.placeholders)
            first = first or name
        elif spill is not None and tensor.dtype != target.dtype and target.device.type == "cpu":
            spill.write(name, tensor.to(target.dtype))
        else:
            set_module_tensor_to_device(model, name, target.device, value=resident, dtype=target.dtype, clear_cache=False)


def _to_folder(
    writer: OffloadWriter,
    name: str,
    key: str | None,
    tensor: torch.Tensor,
    info: TensorInfo,
    target: _Target,
    first: str | None,
) -> None:
    """Offload one tensor: a pointer into safetensors when the dtype is unchanged, else a ``.dat`` file.

    ``key`` is the tensor's key in its safetensors file, None for a tensor built in memory.
    """
    if first is not None and writer.index[first]["dtype"] == str(target.dtype).removeprefix("torch."):
        writer.duplicate(name, first)
    elif key is not None and info.is_safetensors and tensor.dtype == target.dtype:
        writer.point(name, info.file, key, tensor.dtype, tensor.shape)
    else:
        writer.write(name, tensor.to(target.dtype))


def _retie(model: nn.Module, plan: _Plan) -> None:
    """Re-tie groups whose members all landed on one (non-disk) device; warn about split groups."""
    for group in plan.tied_groups:
        devices = {str(plan.targets[n].device) for n in group if n in plan.targets}
        if len(devices) == 1 and devices != {"disk"}:
            retie_parameters(model, [group])
        elif len(devices) > 1:
            logger.warning(
                "Tied parameters %s were mapped to different devices %s; they are no longer tied.", group, sorted(devices)
            )
