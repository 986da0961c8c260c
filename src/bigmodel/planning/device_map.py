"""Device-map inference: a pure function of module sizes and per-device budgets.

The planner walks the model in module order and fills the devices in order
(accelerators by index, then ``"cpu"``, then ``"disk"``).  A module that does not fit
on the current device is split into its own tensors and its children, unless its class
is a no-split class or it has no children; then the next device is tried.  Tied
parameters travel as one bundle.  When something ends up offloaded, the execution
device (the first accelerator used, else the cpu) keeps room to bring back the largest
offloaded layer: the plan is redone with that room reserved (see :func:`_plan`).

Sizes and ties come from one walk over the model (:func:`bigmodel.planning.fill.scan_model`,
the same numbers as :func:`bigmodel.compute_module_sizes`); children are listed lazily,
only for modules that get split, so the experts inside a no-split decoder layer of a
mixture-of-experts model are sized but never planned one by one.
"""

from __future__ import annotations

import logging
import math
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

from ..core.coverage import check_covered, is_covered
from ..core.devices import DeviceSpec, DeviceSpecError, normalize_device
from ..core.tensors import get_non_persistent_buffers
from ..core.warn import caller_stacklevel
from .fill import (
    Placed,
    PlanContext,
    fill_devices,
    largest_layer,
    offload_need,
    scan_model,
    shared_buffer_groups,
    shortfall,
)
from .memory import get_balanced_memory, get_max_memory
from .no_split import NoSplit, no_split_names

logger = logging.getLogger(__name__)

STRING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
_REFILL_ROUNDS = 6


def _no_split_set(model: nn.Module, no_split_module_classes: NoSplit) -> set[str]:
    names = set(no_split_names(no_split_module_classes) or ())
    if not names:
        return set()
    missing = set(names)
    for module in model.modules():
        missing.discard(type(module).__name__)
        if not missing:
            return names  # usually found in the first decoder layer: no full walk
    if missing != names:  # a model's own list may name classes another configuration uses (Bart's encoder layer)
        logger.info("no_split_module_classes %s match no module of %s.", sorted(missing), type(model).__name__)
        return names
    present = sorted({type(module).__name__ for module in model.modules()})
    warnings.warn(
        f"no_split_module_classes {sorted(missing)} match no module of {type(model).__name__}; they have no "
        f"effect. Use class names that occur in the model, e.g. {present[:8]}.",
        stacklevel=caller_stacklevel(),
    )
    return names


def _budget_list(max_memory: Mapping[DeviceSpec, int | str] | None) -> tuple[list[int | str], list[float]]:
    """The devices to fill, in order, and their budgets: "disk" is always last (unbounded unless given)."""
    if max_memory is not None and not max_memory:
        raise ValueError("max_memory is empty; give at least one device budget, e.g. {0: '20GiB', 'cpu': '60GiB'}.")
    budgets: dict[int | str, float] = dict(get_max_memory(max_memory))
    budgets.setdefault("disk", math.inf)  # as the incumbent: what fits nowhere else goes to disk
    return list(budgets), list(budgets.values())


def infer_auto_device_map(
    model: nn.Module,
    max_memory: Mapping[DeviceSpec, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    verbose: bool = False,
    clean_result: bool = True,
    offload_buffers: bool = False,
    fallback_allocation: bool = False,
) -> dict[str, int | str]:
    """Plan which device holds each module: accelerators in order, then ``"cpu"``, then ``"disk"``.

    Args:
        model: the model; only sizes are read, so a meta model works.
        max_memory: budgets device → bytes or size string (see :func:`bigmodel.get_max_memory`;
            strings in this dict are converted to ints in place).  When None, the measured free
            memory.  ``"disk"`` is always the last device: unbounded, unless a ``"disk"`` key
            gives its budget (transformers, diffusers and peft pass ``{"cpu": ...}`` and expect
            the rest on ``"disk"``).
        no_split_module_classes: class names whose modules are never split across devices
            (e.g. ``["LlamaDecoderLayer"]``; a class object counts as its name).  Names matching no
            module give a warning.
        dtype: size floating tensors as if cast to this dtype.
        special_dtypes: per-tensor dtype overrides, dotted name → dtype.
        verbose: log each placement decision (logging level INFO).
        clean_result: merge children that share a device into their parent (:func:`clean_device_map`).
        offload_buffers: buffers of offloaded modules are offloaded too; when False they stay on
            the execution device, which then keeps room for them.
        fallback_allocation: when the next module fits nowhere on a device that is still empty,
            place the first later layer that fits there instead of leaving the device empty.

    Returns:
        ``OrderedDict`` (as accelerate returns) module or tensor name → device (int, ``"cpu"`` or ``"disk"``),
        in module order.

    Raises:
        ValueError: a module fits on no device (names it, its size in bytes and the fix), or a
            budget key or size is invalid.
        TypeError: a ``no_split_module_classes`` entry that is neither a string nor a class.
    """
    no_split = _no_split_set(model, no_split_module_classes)
    devices, limits = _budget_list(max_memory)
    sizes, tied = scan_model(model, dtype, special_dtypes)
    ctx = PlanContext.build(
        model,
        sizes,
        tied + shared_buffer_groups(model),  # a block under several names: all its names on one device
        no_split=no_split,
        devices=devices,
        limits=limits,
        offload_buffers=offload_buffers,
        fallback=fallback_allocation,
        verbose=verbose,
    )
    placed = _plan(ctx)
    device_map = {unit.name: device for unit, device in sorted(placed, key=lambda item: item[0].key)}
    if clean_result:
        device_map = clean_device_map(device_map)
    if verbose:
        logger.info("Device map: %s", device_map)
    return OrderedDict(device_map)  # as accelerate returns it (code that checks the type sees the same)


def _plan(ctx: PlanContext) -> Placed:
    """Fill the devices; while the result offloads without room to bring layers back, refill keeping room free.

    The first pass keeps nothing free.  Each refill keeps free what the previous plan needed
    (its largest offloaded layer, plus offloaded buffers when they stay on the execution
    device).  The execution device always keeps at least the reserve free, so a refill that
    still falls short needed strictly more: the reserve grows until the plan is consistent.
    After a few rounds the largest layer of the model (an upper bound) is reserved.

    Raises:
        ValueError: a module fits on no device (from :func:`fill_devices`), with or without
            the room kept free.
    """
    placed, reserve = fill_devices(ctx, reserve=0), 0
    for _ in range(_REFILL_ROUNDS):
        if shortfall(ctx, placed) <= 0:
            return placed
        need = offload_need(ctx, placed)[1]
        if need <= reserve:
            break  # the execution device's budget is below the reserve: more rounds cannot help
        reserve = need
        if ctx.verbose:
            logger.info("Offloaded layers need %d bytes free on the execution device; planning again.", need)
        placed = fill_devices(ctx, reserve=reserve)
    if shortfall(ctx, placed) <= 0:
        return placed
    upper = largest_layer(ctx, ctx.root) + (0 if ctx.offload_buffers else ctx.buffer_bytes(ctx.root))
    placed = fill_devices(ctx, reserve=max(reserve, upper))
    _warn_if_short(ctx, placed)
    return placed


def _warn_if_short(ctx: PlanContext, placed: Placed) -> None:
    missing = shortfall(ctx, placed)
    if missing > 0:
        execution, need = offload_need(ctx, placed)
        logger.warning(
            "Device %r cannot keep %s bytes free to bring back offloaded layers (%s bytes short); "
            "raise its budget in max_memory.",
            execution,
            f"{need:,}",
            f"{missing:,}",
        )


def clean_device_map(device_map: dict[str, int | str], module_name: str = "") -> dict[str, int | str]:
    """Merge the entries under a module into one entry when there are several and they share a device.

    ``{"a.x": 0, "a.y": 0, "b": 1}`` becomes ``{"a": 0, "b": 1}``, and a map whose entries all
    share one device becomes ``{module_name: device}``.  A module reached by one entry only keeps
    that entry's key (``{"a": 0, "b.inner.0": 1}`` is left as it is), as accelerate 1.15 does.
    Only entries under ``module_name`` (``""``: all of them) are merged.  The map is changed in
    place and returned.

    Args:
        device_map: module or tensor name → device.
        module_name: the subtree to clean.

    Returns:
        ``device_map`` itself, cleaned, in its original order.
    """
    mixed = object()
    state: dict[str, list] = {}  # module strictly above some entries → [their device or mixed, count]
    for name, device in device_map.items():
        prefix = name
        while _is_under(name, module_name) and prefix != module_name:
            prefix = prefix.rpartition(".")[0] if "." in prefix else ""
            seen = state.setdefault(prefix, [device, 0])
            seen[1] += 1
            if seen[0] is not mixed and seen[0] != device:
                seen[0] = mixed
    cleaned: dict[str, int | str] = {}
    for name, device in device_map.items():
        top, prefix = name, name
        while _is_under(name, module_name) and prefix != module_name:
            prefix = prefix.rpartition(".")[0] if "." in prefix else ""
            if state[prefix][0] is not mixed and state[prefix][1] > 1:
                top = prefix
        cleaned.setdefault(top, device)
    device_map.clear()
    device_map.update(cleaned)
    return device_map


def _is_under(name: str, module_name: str) -> bool:
    return not module_name or name == module_name or name.startswith(module_name + ".")


UNKNOWN_KEYS_WARNING = "The following device_map keys do not match any submodules in the model"


def unknown_device_map_keys(model: nn.Module, device_map: Mapping[str, object]) -> list[str]:
    """The keys of ``device_map`` that name no module, parameter or buffer of ``model`` (``""`` names the model).

    Returns:
        Those keys, in the map's order.
    """
    known = {name for name, _ in model.named_modules(remove_duplicate=False)}
    known.update(name for name, _ in model.named_parameters(remove_duplicate=False))
    known.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    return [key for key in device_map if key != "" and key not in known]


def check_device_map(model: nn.Module, device_map: Mapping[str, object]) -> None:
    """Check that every parameter and persistent buffer of ``model`` is covered by ``device_map``.

    A name is covered by its longest prefix in the map (``""`` covers everything).  Buffers
    registered with ``persistent=False`` (not in the state dict, e.g. a rotary embedding's
    ``inv_freq``) need not be covered, as with the incumbent: :func:`uncovered_buffers` lists
    them and ``dispatch_model`` puts them on the main device.  Keys that name nothing in the
    model (a map written for another model, a typo) are ignored with a ``UserWarning`` listing
    them, worded as the incumbent words it.

    Raises:
        UncoveredTensorError: a ValueError (and KeyError) naming the uncovered parameters/buffers and
            how to fix the map.
    """
    unknown = unknown_device_map_keys(model, device_map)
    if unknown:
        warnings.warn(f"{UNKNOWN_KEYS_WARNING}: {unknown}", UserWarning, stacklevel=caller_stacklevel())
    transient = get_non_persistent_buffers(model, recurse=True, fqns=True)
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [name for name, _ in model.named_buffers(remove_duplicate=False) if name not in transient]
    check_covered(names, device_map, type(model).__name__)


def uncovered_buffers(model: nn.Module, device_map: Mapping[str, object]) -> list[str]:
    """The buffers of ``model`` that no key of ``device_map`` covers (only non-persistent ones pass
    :func:`check_device_map`).

    Returns:
        Their dotted names, in ``named_buffers`` order.
    """
    keys = set(device_map)
    return [name for name, _ in model.named_buffers(remove_duplicate=False) if not is_covered(name, keys)]


def resolve_device_map(
    model: nn.Module,
    device_map: str | Mapping[str, DeviceSpec],
    max_memory: Mapping[DeviceSpec, int | str] | None = None,
    no_split_module_classes: list[str] | None = None,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    offload_buffers: bool = False,
) -> dict[str, DeviceSpec]:
    """Turn a device map argument into a checked dict.

    ``"auto"`` and ``"balanced"`` plan over balanced budgets (:func:`get_balanced_memory`),
    ``"balanced_low_0"`` also keeps the first accelerator as empty as possible, and
    ``"sequential"`` fills the devices in order.  A dict is checked (devices valid, every
    parameter and buffer covered) and returned as a new dict.

    Raises:
        ValueError: an unknown string (lists the accepted ones), an invalid device in a dict
            map (names the entry), or parameters the map does not cover.
    """
    if isinstance(device_map, str):
        if device_map not in STRING_MAPS:
            raise ValueError(f"device_map={device_map!r} is not a known map; use a dict or one of {list(STRING_MAPS)}.")
        if device_map == "sequential":
            budgets = get_max_memory(max_memory)
        else:
            low_zero = device_map == "balanced_low_0"
            budgets = get_balanced_memory(model, max_memory, no_split_module_classes, dtype, special_dtypes, low_zero)
        return infer_auto_device_map(
            model, budgets, no_split_module_classes, dtype, special_dtypes, offload_buffers=offload_buffers
        )
    if not isinstance(device_map, Mapping):
        raise ValueError(f"device_map must be a dict or one of {list(STRING_MAPS)}, not {type(device_map).__name__}.")
    for name, device in device_map.items():
        try:
            normalize_device(device)
        except ValueError as err:
            kind = DeviceSpecError if isinstance(err, DeviceSpecError) else ValueError
            raise kind(f"device_map[{name!r}]: {err}") from err
    check_device_map(model, device_map)
    return {name: _plain(device) for name, device in device_map.items()}


def _plain(device: DeviceSpec) -> DeviceSpec:
    """A numpy integer device index as an int (the rest of bigmodel, like torch, takes ints); else as given."""
    return int(device) if isinstance(device, numbers.Integral) and not isinstance(device, bool) else device

