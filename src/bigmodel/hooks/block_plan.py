"""A block's kept values put in, and put back, in one pass (the decode fast path of block hooks).

When every offloading member of a block put in only values it kept from an earlier forward
(:mod:`bigmodel.hooks.kept`), the block's hook records a :class:`BlockPlan`: flat lists of the
members and of their tensors.  At the next forward, :func:`put_in_plan` checks in one pass that
everything a member's own load would check is unchanged (the member's hooks and forward, whether
it offloads, its registered parameters and offloaded names, its weights map, execution device and
each value's token, the placeholder's dtype and ``requires_grad``, grad mode, tied values) and then
puts the same Parameters in; :func:`put_back_plan` puts the placeholders back.  Anything
different and the block falls back to the member-by-member path, which puts in exactly what a load would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .forward import WeakBoundMethod
from .kept import _current as current

# (member.__dict__, the member's hook, its hooked forward, the forward set on the instance before
# hooking (None: the class's forward), the hook's offload flag when the plan was made)
_Member = tuple[dict, Any, Any, Any, bool]
# (the member's _parameters, its hook, count of those parameters, count of the hook's offloaded names,
# the hook's weights map, its execution_device as the values were built for): checked for each member that offloads
_Offloading = tuple[dict, Any, int, int, Any, Any]
# (the member's _parameters, name, slot, kept entry, the hook's kept values, token getter, tied map)
_Tensor = tuple[dict, str, Any, Any, Any, Any, Any]


class BlockPlan:
    """The members of a block and their kept values, as :func:`put_in_plan` puts them in."""

    __slots__ = ("bypassed", "members", "offloading", "tensors")

    def __init__(self, bypassed: list, members: list[_Member], offloading: list[_Offloading],
                 tensors: list[_Tensor]) -> None:
        self.bypassed = bypassed  # (member, hook, hooked forward), as bypass_members returns them
        self.members = members
        self.offloading = offloading
        self.tensors = tensors


class PlanSlot:
    """Holds a block hook's :class:`BlockPlan`; a copy of it holds none (a copied hook plans its own)."""

    __slots__ = ("plan",)

    def __init__(self) -> None:
        self.plan: BlockPlan | None = None

    def __deepcopy__(self, memo: dict) -> PlanSlot:
        return PlanSlot()

    def __copy__(self) -> PlanSlot:
        return PlanSlot()

    def __reduce__(self) -> tuple:
        return (PlanSlot, ())


class PlannedBypass(list):
    """The members taken over by :func:`put_in_plan` (a :data:`~bigmodel.hooks.members.Bypassed` list)."""

    plan: BlockPlan


def make_plan(bypassed: list[tuple[nn.Module, Any, Any]], members: int) -> BlockPlan | None:
    """The plan of a block whose members (all ``members`` of them taken over, in ``bypassed``) hold
    the values their hooks kept, as simple Parameters of their own; None when any does not."""
    if len(bypassed) != members:
        return None
    plan_members: list[_Member] = []
    offloading: list[_Offloading] = []
    tensors: list[_Tensor] = []
    for member, hook, hooked in bypassed:
        state = member.__dict__
        old = state.get("_old_forward")
        plan_members.append((state, hook, hooked, None if type(old) is WeakBoundMethod else old, hook.offload))
        if not hook.offload:
            continue
        kept = hook.__dict__.get("_kept")
        source = kept.source if kept else None
        if source is None or source[1] is None or hook.tied_pointers_to_remove or hook.place_submodules:
            return None
        params = member._parameters
        for name, slot in hook._slots.items():
            entry = kept.get(name)
            if entry is None or not entry.simple or params.get(name) is not entry.loaded:
                return None
            tensors.append((params, name, slot, entry, kept, source[1][0], hook.tied_params_map))
        offloading.append((params, hook, len(params), len(hook._slots), hook.weights_map, hook.execution_device))
    return BlockPlan(list(bypassed), plan_members, offloading, tensors)


def put_in_plan(plan: BlockPlan, grad: bool) -> PlannedBypass | None:
    """Put the plan's kept values in and set the members' hooked forwards aside, if all is unchanged.

    Returns:
        The members taken over (for :func:`put_back_plan`), or None when anything changed since the
        plan was made (nothing was put in: the member-by-member path does the load).
    """
    members = plan.members
    for state, hook, hooked, _, offload in members:
        # a member whose offloading was turned back on (align_modules-style code sets hook.offload to
        # False while it holds the weights in) loads them again: the plan holds nothing for it
        if state.get("_hf_hook") is not hook or state.get("forward") is not hooked or hook.offload != offload:
            return None
    for params, hook, n_params, n_slots, weights_map, device in plan.offloading:
        if (not hook.offload or len(params) != n_params or len(hook._slots) != n_slots
                or hook.weights_map is not weights_map or hook.tied_pointers_to_remove or hook.execution_device is not device):
            return None
    tensors = plan.tensors
    if tensors:
        with torch._C.DisableTorchFunctionSubclass():
            for _, name, slot, entry, kept, get, tied_map in tensors:
                if kept.get(name) is not entry or not current(entry, slot, get(entry.key), grad):
                    return None
                if tied_map and entry.pointer in tied_map:
                    return None
        for params, name, _, entry, _, _, _ in tensors:
            params[name] = entry.loaded
    for state, _, _, old, _ in members:
        if old is None:
            del state["forward"]  # the class's forward runs
        else:
            state["forward"] = old  # a forward set on the instance before hooking
    taken = PlannedBypass(plan.bypassed)
    taken.plan = plan
    return taken


def put_back_plan(taken: PlannedBypass) -> bool:
    """Put the placeholders and the hooked forwards back after :func:`put_in_plan`, if each member
    still holds its kept value in its placeholder's dtype and no tied value is to be dropped; False
    (nothing changed) when the member-by-member path must do it (it ends in the same state for a
    member whose hook changed during the forward: placeholders and hooked forward back)."""
    plan = taken.plan
    for _, hook, _, _, _, _ in plan.offloading:
        if hook.tied_pointers_to_remove:
            return False
    tensors = plan.tensors
    if tensors:
        with torch._C.DisableTorchFunctionSubclass():
            for params, name, slot, entry, _, _, _ in tensors:
                held = params.get(name)
                if held is not entry.loaded or held.dtype is not slot.placeholder.dtype:
                    return False
        for params, name, slot, _, _, _, _ in tensors:
            params[name] = slot.placeholder
    for state, _, hooked, _, _ in plan.members:
        state["forward"] = hooked
    return True
