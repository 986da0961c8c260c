"""Memory budgets: free memory per device, and budgets that balance a model over accelerators.

A budget is a dict device → bytes, keyed like a device map: accelerator indices (ints,
in increasing order), then ``"cpu"``, then ``"disk"``.  Integer keys are labels only:
planning reads budgets and sizes, so ``{0: ..., 2: ..., "cpu": ...}`` works on a
machine without any accelerator.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping

import psutil
import torch
from torch import nn

from ..core.devices import (
    DeviceSpec,
    accelerator_count,
    accelerator_memory_info,
    device_sort_key,
    normalize_device,
)
from ..core.sizes import compute_module_sizes, convert_file_size_to_int
from .no_split import no_split_names

logger = logging.getLogger(__name__)

Budgets = dict[int | str, int]

# Share of a single accelerator used when the caller gave no budget: the rest is left for activations.
_SINGLE_ACCELERATOR_SHARE = 0.9
# Balanced budgets add this many "layers" on top of an even share, so greedy filling does not push the
# tail of the model off the last accelerator.  A layer is the larger of the largest no-split module and
# the mean leaf module: accelerate 1.15's slack, so "balanced" maps are the ones its users know.
_BALANCE_SLACK_LAYERS = 1.25

_ACCEPTED_KEYS = "an accelerator index (0, 1, ...), a string like 'cuda:0' or 'xpu:1', 'cpu' or 'disk'"


def _budget_key(key: DeviceSpec) -> int | str:
    """Canonical budget key for ``key``: an accelerator index, ``"cpu"`` or ``"disk"``."""
    try:
        device = normalize_device(key)
    except ValueError:
        device = None
    if device is None or device == "meta":
        raise ValueError(f"max_memory key {key!r} is not a device; use {_ACCEPTED_KEYS}.")
    return device


def _detected_budgets() -> Budgets:
    budgets: Budgets = {}
    for index in range(accelerator_count()):
        info = accelerator_memory_info(index)
        # Backends that cannot report free memory (unified-memory devices) share host RAM.
        budgets[index] = info[0] if info is not None else psutil.virtual_memory().available
    budgets["cpu"] = psutil.virtual_memory().available
    return budgets


def get_max_memory(max_memory: Mapping[DeviceSpec, int | str] | None = None) -> Budgets:
    """Per-device memory budgets in bytes.

    Args:
        max_memory: budgets given by the caller, device → bytes (int) or a size string
            (``"10GiB"``, ``"500MB"``).  Keys may be ints, ``"cuda:1"``-style strings,
            :class:`torch.device`, ``"cpu"`` or ``"disk"``.  When None, the free memory of
            every accelerator (through :mod:`torch.accelerator`) and the available RAM
            (``psutil.virtual_memory().available``) are measured.

    Returns:
        a new dict device → bytes, accelerators first (by index), then ``"cpu"``, then
        ``"disk"``.  As with the incumbent, the size strings of a caller's ``max_memory`` are
        also replaced by their ints **in that dict** (its keys are kept as spelled):
        transformers reads the dict it passed again and compares its values with ints.  A
        dict with any invalid entry is left unchanged.

    Raises:
        ValueError: a key is not a device (names it and the accepted forms), two keys name
            the same device, or a size does not parse.
        TypeError: ``max_memory`` is not a mapping (names what was given).
    """
    if max_memory is None:
        return _detected_budgets()
    if not isinstance(max_memory, Mapping):
        raise TypeError(
            f"max_memory={max_memory!r} (a {type(max_memory).__name__}) is not a budget map; pass a dict device → "
            "bytes or size string, e.g. {'cpu': '1GB'} or {0: '10GiB', 'cpu': '30GiB'}, or None to measure."
        )
    budgets: Budgets = {}
    converted: dict[DeviceSpec, int] = {}
    for key, value in max_memory.items():
        device = _budget_key(key)
        if device in budgets:
            raise ValueError(f"max_memory names device {device!r} twice (key {key!r}); keep one entry per device.")
        try:
            budgets[device] = converted[key] = convert_file_size_to_int(value)
        except ValueError as err:
            raise ValueError(f"max_memory[{key!r}]: {err}") from err
    if isinstance(max_memory, MutableMapping):
        for key, size in converted.items():
            if isinstance(max_memory[key], str):
                max_memory[key] = size
    _warn_absent(budgets)
    return dict(sorted(budgets.items(), key=lambda item: device_sort_key(item[0])))


_WARNED_ABSENT: set[tuple[int, ...]] = set()


def _warn_absent(budgets: Mapping[int | str, int]) -> None:
    """Log a warning (as the incumbent does) for accelerator indices this machine does not have: a map
    planned with them can be written (``bigmodel plan`` for another machine) but not dispatched here."""
    count = accelerator_count()
    absent = tuple(sorted(d for d in budgets if isinstance(d, int) and d >= count))
    if absent and absent not in _WARNED_ABSENT:  # once per process and set of indices (a plan asks several times)
        _WARNED_ABSENT.add(absent)
        logger.warning(
            "max_memory names accelerator(s) %s, which this machine does not have (%d found): a device map "
            "planned with them cannot be dispatched here; drop those keys to plan for this machine.", list(absent), count,
        )


def _balance_layer_size(
    model: nn.Module, sizes: Mapping[str, int], no_split_module_classes: list[str] | str | None
) -> int:
    """Bytes of the "layer" that balanced budgets leave room for: the largest of the no-split classes'
    sizes, each class sized by its first module holding tensors (as accelerate 1.15 does, so a model
    whose later blocks of a class are wider gets the same budgets), or the mean of the leaf modules
    that hold tensors (root excluded), whichever is larger."""
    no_split = set(no_split_names(no_split_module_classes) or ())
    first_of_class: dict[str, int] = {}
    leaves = []
    for name, module in model.named_modules():
        size = sizes.get(name, 0)
        class_name = type(module).__name__
        if name and class_name in no_split and name in sizes:
            first_of_class.setdefault(class_name, size)
        if name and size > 0 and next(module.children(), None) is None:
            leaves.append(size)
    mean_leaf = sum(leaves) // len(leaves) if leaves else 0
    return max(max(first_of_class.values(), default=0), mean_leaf)


def get_balanced_memory(
    model: nn.Module,
    max_memory: Mapping[DeviceSpec, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    low_zero: bool = False,
) -> Budgets:
    """Budgets that spread ``model`` evenly over the accelerators.

    Every accelerator but the last is capped at an even share of the model (rounded down)
    plus slack, so filling the accelerators in order leaves each about as full as the others;
    the last one keeps its whole budget for the remainder.  The slack is 1.25 times the larger
    of the size of a ``no_split_module_classes`` class (its first module holding tensors; the
    largest over the classes) and the mean size of the leaf modules holding tensors (the root
    excluded), the budgets accelerate 1.15 gives.  ``"cpu"``
    and ``"disk"`` budgets are unchanged.

    Args:
        model: the model (meta is fine: only sizes are read).
        max_memory: budgets as for :func:`get_max_memory` (measured when None).
        no_split_module_classes: class names never split across devices.
        dtype: size floating tensors as if cast to this dtype.
        special_dtypes: per-tensor dtype overrides, dotted name → dtype.
        low_zero: keep the first accelerator as empty as possible (it stays free for
            ``generate()`` buffers): it only gets what the others cannot hold.

    Returns:
        dict device → bytes, in the order of :func:`get_max_memory`.

    Raises:
        ValueError: as :func:`get_max_memory`.
    """
    user_budgets = max_memory is not None
    budgets = get_max_memory(max_memory)
    accelerators = [d for d, size in budgets.items() if isinstance(d, int) and size > 0]
    if not accelerators:
        return budgets
    if len(accelerators) == 1:
        if not user_budgets:
            only = accelerators[0]
            budgets[only] = int(budgets[only] * _SINGLE_ACCELERATOR_SHARE)
            logger.info("Using %d bytes of accelerator %s; the rest stays free for activations.", budgets[only], only)
        return budgets
    sizes = compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes)
    low_zero = low_zero and len(accelerators) > 1
    sharing = accelerators[1:] if low_zero else accelerators
    slack = int(_BALANCE_SLACK_LAYERS * _balance_layer_size(model, sizes, no_split_module_classes))
    share = sizes[""] // len(sharing) + slack
    for device in sharing[:-1]:
        budgets[device] = min(budgets[device], share)
    if low_zero:
        first = accelerators[0]
        others = sum(budgets[d] for d in sharing)
        budgets[first] = min(budgets[first], max(0, sizes[""] - others))
    return budgets
