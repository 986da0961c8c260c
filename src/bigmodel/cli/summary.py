"""What a device map does with a model: bytes and layers per device, and budgets that offload a share.

Pure functions of a (meta) model and a map: nothing here reads weights, so they run on a
405B-parameter config in well under a second.  A *layer* is a module whose class is in
the no-split classes (a transformer block, ``LlamaDecoderLayer``...).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..core.devices import device_sort_key
from ..core.sizes import compute_module_sizes
from ..core.tensors import device_of, find_tied_parameters
from ..hooks.registry import TIED_PARAMS
from ..offload.format import parse_dtype


@dataclass(frozen=True)
class DeviceUsage:
    """What one device holds under a device map.

    Attributes:
        device: ``int`` accelerator index, ``"cpu"`` or ``"disk"``.
        nbytes: bytes of the parameters and buffers placed there.
        layers: number of no-split layers placed there.
        tensors: number of parameters and buffers placed there.
    """

    device: int | str
    nbytes: int
    layers: int
    tensors: int


def _no_split(model: nn.Module, given: list[str] | None) -> list[str]:
    """The given layer classes, else the model's ``_no_split_modules`` (transformers convention)."""
    return list(getattr(model, "_no_split_modules", None) or ()) if given is None else list(given)


def _layer_names(model: nn.Module, no_split_module_classes: list[str]) -> list[str]:
    no_split = set(no_split_module_classes)
    return [name for name, module in model.named_modules() if type(module).__name__ in no_split]


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Groups of tied parameter names: those tied now, and those dispatch recorded as tied.

    Dispatching a model whose tied weights are offloaded replaces each of them by its own
    ``meta`` placeholder, so the tie is no longer visible by identity; dispatch records
    the groups on the model (see :func:`bigmodel.dispatch_model`), and they are read here.
    """
    groups = [list(group) for group in find_tied_parameters(model)]
    known = {frozenset(group) for group in groups}
    for group in model.__dict__.get(TIED_PARAMS) or ():
        if frozenset(group) not in known:
            groups.append(list(group))
            known.add(frozenset(group))
    return groups


def tensor_sizes(model: nn.Module, dtype: torch.dtype | str | None = None) -> dict[str, int]:
    """Bytes of every parameter and buffer, each tied group counted once under its first name.

    The first name is the one :meth:`nn.Module.named_parameters` gives first, as in
    :func:`bigmodel.compute_module_sizes`; ties broken by offloading (see :func:`tied_groups`)
    are counted once too.
    """
    sizes = compute_module_sizes(model, dtype=dtype)
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    order = {name: index for index, name in enumerate(names)}
    duplicates: set[str] = set()
    for group in tied_groups(model):
        present = sorted((name for name in group if name in order), key=order.__getitem__)
        duplicates.update(present[1:])
    return {name: sizes[name] for name in names if name in sizes and name not in duplicates}


def device_map_usage(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> list[DeviceUsage]:
    """Bytes, layers and tensors each device of ``device_map`` holds, devices in fill order.

    Args:
        model: the model (meta is fine: only shapes are read).
        device_map: module name → device; every tensor must be covered.
        no_split_module_classes: class names that count as layers; ``model._no_split_modules`` when None.
        dtype: size floating tensors as if cast to it.

    Returns:
        One :class:`DeviceUsage` per device that holds something.

    Raises:
        KeyError: a tensor the map does not cover (names it).
    """
    no_split = _no_split(model, no_split_module_classes)
    nbytes: dict[int | str, int] = {}
    counts: dict[int | str, int] = {}
    tensor_device: dict[str, int | str] = {}
    for name, size in tensor_sizes(model, dtype).items():
        device = device_of(name, device_map)
        tensor_device[name] = device
        nbytes[device] = nbytes.get(device, 0) + size
        counts[device] = counts.get(device, 0) + 1
    layers: dict[int | str, int] = {}
    for layer in _layer_names(model, no_split):
        inside = [d for n, d in tensor_device.items() if n.startswith(layer + ".")]
        if inside:
            layers[inside[0]] = layers.get(inside[0], 0) + 1
    return [
        DeviceUsage(device, nbytes[device], layers.get(device, 0), counts[device])
        for device in sorted(nbytes, key=device_sort_key)
    ]


@dataclass(frozen=True)
class StoredOnDisk:
    """What the ``"disk"`` tensors of a load take as stored, quantized offload included.

    Attributes:
        nbytes: bytes of the disk tensors as stored: quantized ones as their parts (data,
            scales, zero points) in the offload folder, the others at their planned size.
        planned: bytes of the same tensors as planned (the table's ``disk`` row).
        quantized: number of disk tensors stored quantized.
        forms: the quantized forms found (``"int8"``...), sorted.
    """

    nbytes: int
    planned: int
    quantized: int
    forms: tuple[str, ...]


def stored_on_disk(
    model: nn.Module,
    device_map: Mapping[str, int | str],
    index: Mapping[str, Mapping],
    dtype: torch.dtype | str | None = None,
) -> StoredOnDisk:
    """Bytes the disk tensors of ``device_map`` take as stored, read from the offload folder's index.

    Args:
        model: the (meta) model the map was planned for.
        device_map: module name → device.
        index: the offload folder's ``index.json`` (:func:`bigmodel.offload.format.load_offload_index`);
            a quantized entry lists its parts' dtypes and shapes (see :mod:`bigmodel.offload.quantized_store`).
        dtype: the dtype the tensors were planned in.
    """
    nbytes = planned = quantized = 0
    forms: set[str] = set()
    for name, size in tensor_sizes(model, dtype).items():
        if device_of(name, device_map) != "disk":
            continue
        planned += size
        quantization = (index.get(name) or {}).get("quantization")
        if not isinstance(quantization, Mapping):
            nbytes += size
            continue
        parts = quantization.get("parts", {}).values()
        nbytes += sum(parse_dtype(p["dtype"], name).itemsize * torch.Size(p["shape"]).numel() for p in parts)
        quantized += 1
        forms.add(str(quantization.get("form")))
    return StoredOnDisk(nbytes, planned, quantized, tuple(sorted(forms)))


def count_layers(model: nn.Module, no_split_module_classes: list[str] | None = None) -> int:
    """Number of no-split layers in ``model``."""
    return len(_layer_names(model, _no_split(model, no_split_module_classes)))


def cpu_budget_for_disk_share(
    model: nn.Module,
    share: float = 0.5,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
) -> int:
    """The smallest CPU budget under which at most ``share`` of the layers are planned onto disk.

    Searches the budget by bisection over :func:`bigmodel.infer_auto_device_map` with
    ``{"cpu": budget, "disk": unbounded}`` (no accelerator), so the result matches what the planner does,
    reserve for the largest offloaded layer included.

    Args:
        model: the (meta) model.
        share: fraction of the layers to leave on disk, between 0 and 1.
        no_split_module_classes: layer classes; ``model._no_split_modules`` when None.
        dtype: plan sizes as if floating weights were cast to it.

    Returns:
        The CPU budget in bytes.

    Raises:
        ValueError: ``share`` outside [0, 1].
    """
    from ..planning.device_map import infer_auto_device_map

    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share={share} is not a fraction; pass a number between 0 and 1.")
    no_split = _no_split(model, no_split_module_classes)
    target = int(count_layers(model, no_split) * share)

    def layers_on_disk(budget: int) -> int:
        budgets = {"cpu": budget, "disk": 2**62}
        plan = infer_auto_device_map(model, max_memory=budgets, no_split_module_classes=no_split, dtype=dtype)
        usage = {u.device: u for u in device_map_usage(model, plan, no_split, dtype)}
        return usage["disk"].layers if "disk" in usage else 0

    low, high = -1, 2 * compute_module_sizes(model, dtype=dtype)[""]
    planning_log = logging.getLogger("bigmodel.planning.device_map")
    quiet = logging.Filter("no such logger")  # the probes below are not plans the user asked for
    planning_log.addFilter(quiet)
    try:
        while high - low > 1:
            middle = (low + high) // 2
            if layers_on_disk(middle) <= target:
                high = middle
            else:
                low = middle
    finally:
        planning_log.removeFilter(quiet)
    return high
