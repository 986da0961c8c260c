"""The filling engine behind :func:`bigmodel.infer_auto_device_map`.

Units are what gets a device-map entry: a module placed whole, or one direct
parameter/buffer of a module that was split.  :func:`fill_devices` walks the units in
module order and fills the devices in order.  It is a pure function of sizes, ties and
budgets; the model is read only for its structure, lazily, when a module is split.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..core.sizes import planned_size
from ..core.tensors import name_prefixes

logger = logging.getLogger("bigmodel.planning.device_map")


@dataclass(eq=False, slots=True)
class Unit:
    """A module placed whole (``module`` set) or one direct tensor of a split module (``module`` None)."""

    name: str
    module: nn.Module | None
    size: int  # bytes, as compute_module_sizes counts them (a tied tensor only under its first name)
    key: tuple[int, ...]  # position in module order
    is_buffer: bool = False


@dataclass
class PlanContext:
    """Everything the fill passes read: sizes, ties, budgets and options (built once per plan)."""

    root: Unit
    sizes: Mapping[str, int]
    no_split: set[str]
    devices: list[int | str]
    limits: list[float]
    offload_buffers: bool = False
    fallback: bool = False
    verbose: bool = False
    groups: list[list[str]] = field(default_factory=list)
    groups_under: dict[str, set[int]] = field(default_factory=dict)  # name → tie groups with a member under it
    canonical: dict[str, str] = field(default_factory=dict)  # alias tensor name → the name holding its size
    layer_memo: dict[str, int] = field(default_factory=dict)
    buffer_memo: dict[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, model: nn.Module, sizes: Mapping[str, int], tied: list[list[str]], **options: object) -> PlanContext:
        """Context for ``model`` with its sizes (bytes) and tied groups; ``options`` are the remaining fields."""
        root = Unit("", model, sizes.get("", 0), ())
        ctx = cls(root=root, sizes=sizes, groups=tied, **options)  # type: ignore[arg-type]
        for index, group in enumerate(tied):
            counted = next((name for name in group if name in sizes), group[0])
            for name in group:
                if name != counted:
                    ctx.canonical[name] = counted
                for prefix in name_prefixes(name):
                    ctx.groups_under.setdefault(prefix, set()).add(index)
        return ctx

    def splittable(self, unit: Unit) -> bool:
        module = unit.module
        return module is not None and bool(module._modules) and type(module).__name__ not in self.no_split

    def children(self, unit: Unit) -> list[Unit]:
        """The direct parameters, direct buffers and child modules of a split module, in that order."""
        module, prefix, sizes = unit.module, f"{unit.name}." if unit.name else "", self.sizes
        units: list[Unit] = []
        for is_buffer, tensors in ((False, module._parameters), (True, module._buffers)):
            for name, tensor in tensors.items():
                if tensor is not None:
                    full = prefix + name
                    units.append(Unit(full, None, sizes.get(full, 0), (*unit.key, len(units)), is_buffer))
        for name, child in module._modules.items():
            if child is not None:
                full = prefix + name
                units.append(Unit(full, child, sizes.get(full, 0), (*unit.key, len(units))))
        return units

    def tensor_bytes(self, name: str) -> int:
        return self.sizes.get(self.canonical.get(name, name), 0)

    def buffer_bytes(self, unit: Unit) -> int:
        """Bytes of the buffers under ``unit``."""
        if unit.module is None:
            return unit.size if unit.is_buffer else 0
        if unit.name not in self.buffer_memo:
            named = unit.module.named_buffers(prefix=unit.name)
            self.buffer_memo[unit.name] = sum(self.sizes.get(name, 0) for name, _ in named)
        return self.buffer_memo[unit.name]


def scan_model(
    model: nn.Module, dtype: torch.dtype | str | None, special_dtypes: Mapping[str, torch.dtype | str] | None
) -> tuple[dict[str, int], list[list[str]]]:
    """Module sizes and tied parameter groups in one walk over the model.

    Returns exactly what :func:`bigmodel.compute_module_sizes` and
    :func:`bigmodel.find_tied_parameters` return (the tests check it), for about half the
    cost of calling both: one explicit-stack walk over ``_modules`` instead of two
    recursive generator walks.  A tensor reached twice is sized once, under the first name.
    """
    sizes: dict[str, int] = {"": 0}
    first_name: dict[int, str] = {}
    tied: dict[int, list[str]] = {}
    order: list[tuple[str, str]] = []  # (module, parent) in preorder
    stack: list[tuple[str, nn.Module, str]] = [("", model, "")]
    while stack:
        name, module, parent = stack.pop()
        order.append((name, parent))
        prefix = f"{name}." if name else ""
        for is_param, tensors in ((True, module._parameters), (False, module._buffers)):
            for tensor_name, tensor in tensors.items():
                if tensor is None:
                    continue
                full = prefix + tensor_name
                seen = first_name.get(id(tensor))
                if seen is not None:
                    if is_param:
                        tied.setdefault(id(tensor), [seen]).append(full)
                    continue
                first_name[id(tensor)] = full
                size = sizes[full] = planned_size(tensor, full, dtype, special_dtypes)
                sizes[name] = sizes.get(name, 0) + size
        stack.extend((prefix + child, sub, name) for child, sub in reversed(module._modules.items()) if sub is not None)
    for name, parent in reversed(order[1:]):  # children before parents: each module adds itself to its parent once
        if name in sizes:
            sizes[parent] = sizes.get(parent, 0) + sizes[name]
    groups = sorted((sorted(set(names)) for names in tied.values()), key=lambda group: group[0])
    return sizes, [group for group in groups if len(group) > 1]


def shared_buffer_groups(model: nn.Module) -> list[list[str]]:
    """Groups of names under which one buffer is registered (a block registered under several names).

    The planner keeps each group on one device, as it keeps tied parameters together.
    """
    names: dict[int, list[str]] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    return sorted((sorted(group) for group in names.values() if len(group) > 1), key=lambda group: group[0])


def largest_layer(ctx: PlanContext, unit: Unit) -> int:
    """Bytes of the largest layer under ``unit``: a leaf or no-split module, or the own tensors of a split one.

    Tied tensors count in full here: a layer brought back for its forward needs all its weights.
    """
    if unit.module is None:
        return ctx.tensor_bytes(unit.name)
    memo = ctx.layer_memo.get(unit.name)
    if memo is not None:
        return memo
    if not ctx.splittable(unit):
        if unit.name in ctx.groups_under:
            tensors = [*unit.module.named_parameters(prefix=unit.name), *unit.module.named_buffers(prefix=unit.name)]
            result = sum(ctx.tensor_bytes(name) for name, _ in tensors)
        else:
            result = unit.size
    else:
        own, largest = 0, 0
        for child in ctx.children(unit):
            if child.module is None:
                own += ctx.tensor_bytes(child.name)
            else:
                largest = max(largest, largest_layer(ctx, child))
        result = max(own, largest)
    ctx.layer_memo[unit.name] = result
    return result


Placed = list[tuple[Unit, "int | str"]]


def _execution_device(ctx: PlanContext, placed: Placed) -> int | str | None:
    """Where offloaded layers run: the first accelerator holding something, else the cpu (None: no cpu budget)."""
    used = {device for _, device in placed}
    accelerators = [device for device in ctx.devices if isinstance(device, int) and device in used]
    if accelerators:
        return accelerators[0]
    return "cpu" if "cpu" in ctx.devices else None


def offload_need(ctx: PlanContext, placed: Placed) -> tuple[int | str | None, int]:
    """``(execution device, bytes it must keep free)``.

    The bytes are the largest offloaded layer, plus the offloaded buffers when those stay on
    the execution device (``offload_buffers=False``); 0 when nothing is offloaded.
    """
    execution = _execution_device(ctx, placed)
    offloaded = ("cpu", "disk") if isinstance(execution, int) else ("disk",)
    largest, buffers, any_offloaded = 0, 0, False
    for unit, device in placed:
        if device in offloaded:
            any_offloaded = True
            largest = max(largest, largest_layer(ctx, unit))
            if not ctx.offload_buffers:
                buffers += ctx.buffer_bytes(unit)
    return execution, (largest + buffers if any_offloaded else 0)


def shortfall(ctx: PlanContext, placed: Placed) -> float:
    """Bytes missing on the execution device to bring back offloaded layers (<= 0: the plan is fine)."""
    execution, need = offload_need(ctx, placed)
    if execution is None or need == 0:
        return 0
    used = sum(unit.size for unit, device in placed if device == execution)
    return need - (ctx.limits[ctx.devices.index(execution)] - used)


def _pending_owner(name: str, pending: Mapping[str, Unit]) -> Unit | None:
    for prefix in name_prefixes(name):
        unit = pending.get(prefix)
        if unit is not None:
            return unit
    return None


def _bundle(ctx: PlanContext, unit: Unit, pending: Mapping[str, Unit]) -> list[Unit]:
    """``unit`` plus the pending units holding parameters tied to its own (transitively)."""
    todo = list(ctx.groups_under.get(unit.name, ()))
    if not todo:
        return [unit]
    bundle, seen_groups = [unit], set(todo)
    while todo:
        for member in ctx.groups[todo.pop()]:
            owner = _pending_owner(member, pending)
            if owner is None or any(owner is other for other in bundle):
                continue
            bundle.append(owner)
            for group in ctx.groups_under.get(owner.name, ()):
                if group not in seen_groups:
                    seen_groups.add(group)
                    todo.append(group)
    return bundle


def _replace(stack: list[Unit], pending: dict[str, Unit], unit: Unit, replacement: list[Unit]) -> None:
    """Put ``replacement`` (in module order) where ``unit`` is in the stack (the stack's top is the next unit)."""
    index = next(i for i in range(len(stack) - 1, -1, -1) if stack[i] is unit)
    stack[index : index + 1] = reversed(replacement)
    del pending[unit.name]
    pending.update((child.name, child) for child in replacement)


def _take_fitting(ctx: PlanContext, unit: Unit, room: float) -> tuple[Unit, list[Unit]] | None:
    """First untied layer under ``unit`` of at most ``room`` bytes: ``(it, the units replacing unit)``."""
    if 0 < unit.size <= room and unit.name not in ctx.groups_under:
        return unit, []
    if not ctx.splittable(unit) or unit.size == 0:
        return None
    children = ctx.children(unit)
    for index, child in enumerate(children):
        found = _take_fitting(ctx, child, room)
        if found is not None:
            return found[0], children[:index] + found[1] + children[index + 1 :]
    return None


def _fallback(ctx: PlanContext, stack: list[Unit], pending: dict[str, Unit], room: float) -> Unit | None:
    """Take the first later layer that fits in ``room`` bytes out of the pending units (None if none fits)."""
    for index in range(len(stack) - 1, -1, -1):
        unit = stack[index]
        if pending.get(unit.name) is not unit:
            continue
        found = _take_fitting(ctx, unit, room)
        if found is not None:
            taken, replacement = found
            _replace(stack, pending, unit, replacement)
            pending.pop(taken.name, None)
            return taken
    return None


def _fits_nowhere(ctx: PlanContext, bundle: list[Unit], size: int, reserve: int) -> ValueError:
    what = repr(bundle[0].name or type(bundle[0].module).__name__)
    if len(bundle) > 1:
        what += f" with the modules tied to it {[unit.name for unit in bundle[1:]]}"
    budgets = ", ".join(f"{device!r}: {limit:,}" for device, limit in zip(ctx.devices, ctx.limits))
    kept = f" ({reserve:,} bytes are kept free on the execution device to bring back offloaded layers)"
    kept = kept if reserve else ""
    fix = (
        'Raise the "disk" budget in max_memory (or the others).'
        if "disk" in ctx.devices
        else 'Add "disk" to max_memory (and pass an offload folder when loading) or raise a budget.'
    )
    return ValueError(
        f"Module {what} ({size:,} bytes) fits on no device with the budgets {{{budgets}}} (bytes){kept}. {fix}"
    )


@dataclass
class _Filling:
    """The state of one fill pass: devices used so far and the units still to place."""

    ctx: PlanContext
    reserve: int
    stack: list[Unit]  # units still to place, the next one on top
    pending: dict[str, Unit]  # name → unit, for the units of the stack not yet placed
    used: list[int]  # bytes placed per device
    placed: Placed = field(default_factory=list)
    current: int = 0  # index of the device being filled
    execution: int | None = None  # index of the execution device once chosen

    def room(self) -> float:
        """Bytes still free on the current device, less the reserve while it may be the execution device."""
        current, device = self.current, self.ctx.devices[self.current]
        keeps = device != "disk" and self.execution in (None, current)
        return self.ctx.limits[current] - self.used[current] - (self.reserve if keeps else 0)

    def put(self, units: list[Unit], size: int) -> None:
        device = self.ctx.devices[self.current]
        for unit in units:
            self.pending.pop(unit.name, None)
            self.placed.append((unit, device))
        self.used[self.current] += size
        if self.execution is None and device != "disk":
            self.execution = self.current
        if self.ctx.verbose:
            logger.info("%s (%d bytes) -> %r", [unit.name for unit in units], size, device)


def fill_devices(ctx: PlanContext, reserve: int) -> Placed:
    """Place every unit, filling devices in order; keep ``reserve`` bytes free on the execution device.

    The execution device is the first accelerator that receives something, or the cpu if
    none does; until one is chosen, every candidate keeps ``reserve`` bytes free.

    Returns:
        ``[(unit, device)]`` in placement order.

    Raises:
        ValueError: a unit (with its tied partners) fits on no remaining device.
    """
    # The model is always split into its children first (as the ecosystem's maps expect), unless it cannot be.
    top = ctx.children(ctx.root) if ctx.splittable(ctx.root) else [ctx.root]
    state = _Filling(ctx, reserve, top[::-1], {unit.name: unit for unit in top}, [0] * len(ctx.devices))
    stack, pending, last = state.stack, state.pending, len(ctx.devices) - 1
    while stack:
        unit = stack.pop()
        if pending.get(unit.name) is not unit:
            continue  # already placed with a tied partner
        bundle = _bundle(ctx, unit, pending)
        size = sum(member.size for member in bundle)
        while size > state.room():
            if ctx.splittable(unit):
                stack.append(unit)  # _replace finds it on top and swaps in its children
                _replace(stack, pending, unit, ctx.children(unit))
                break
            partner = next((member for member in bundle[1:] if ctx.splittable(member)), None)
            if partner is not None:
                _replace(stack, pending, partner, ctx.children(partner))
                bundle = _bundle(ctx, unit, pending)
                size = sum(member.size for member in bundle)
                continue
            taken = None
            if ctx.fallback and state.used[state.current] == 0 and state.current < last:
                taken = _fallback(ctx, stack, pending, state.room())
            if taken is not None:
                state.put([taken], taken.size)
            elif state.current == last:
                raise _fits_nowhere(ctx, bundle, size, reserve)
            else:
                state.current += 1
        else:
            state.put(bundle, size)
    return state.placed
