"""One hook run per block: a block's :class:`~bigmodel.hooks.align_hook.AlignDevicesHook` does the
hook work of its submodules (its *members*) inside the block's forward.

At the block's pre-forward each member's offloaded weights are put in and the member's hooked
``forward`` is set aside (the class's forward, or a forward set on the instance before hooking,
runs instead); at its post-forward (or when the forward raised, or the hook is removed) the
placeholders and the hooked forwards are put back.  A member called outside its block runs
through its own hook as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .forward import HookedForward, WeakBoundMethod
from .block_plan import PlannedBypass, PlanSlot, make_plan, put_back_plan, put_in_plan
from .kept import put_back_all_kept, put_in_all_kept

Bypassed = list[tuple[nn.Module, Any, Any]]  # (member, its hook, its hooked forward)


def split_staged(staged: Mapping[str, torch.Tensor] | None) -> dict[int, dict[str, torch.Tensor]]:
    """Split a block's staged values (keys ``"<id of the hook>|<name>"``) per hook id."""
    split: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in (staged or {}).items():
        owner, _, name = key.partition("|")
        split.setdefault(int(owner), {})[name] = value
    return split


def take_members(hook: Any, module: nn.Module, staged: Mapping[str, torch.Tensor] | None) -> Bypassed:
    """A block hook's pre-forward work: its own weights and its members' put in, their hooks set aside.

    Without staged values, the block's plan (:mod:`bigmodel.hooks.block_plan`) does it in one pass
    when nothing changed since the plan was made; otherwise member by member (:func:`bypass_members`).

    Args:
        hook: the block's :class:`~bigmodel.hooks.align_hook.AlignDevicesHook` (with ``members``).
        module: the block.
        staged: values a prefetch staged for the block (keys ``"<id of the hook>|<name>"``), or None.

    Returns:
        The members taken over, for :func:`restore_members`.
    """
    plans = hook.__dict__.get("_plans")
    if staged is None and not hook.offload and plans is not None and plans.plan is not None:
        taken = put_in_plan(plans.plan, torch.is_grad_enabled())
        if taken is not None:
            return taken
    split = split_staged(staged)
    if hook.offload:
        hook.load_weights(module, split.get(id(hook)))
    return bypass_members(hook.members, split, plans)


def bypass_members(members: Sequence[tuple[nn.Module, Any]], split: Mapping[int, Mapping[str, torch.Tensor]],
                   plans: PlanSlot | None = None) -> Bypassed:
    """Put each member's offloaded weights in and set its hooked forward aside.

    Args:
        members: ``(submodule, its AlignDevicesHook)`` pairs.
        split: staged values per hook id (:func:`split_staged`); a hook without an entry reads its own
            (or puts in the values it kept from its last forward, see :mod:`bigmodel.hooks.kept`).
        plans: the block's :class:`~bigmodel.hooks.block_plan.PlanSlot`: without staged values, a new
            plan is made from the members taken over (see :func:`take_members`).

    Returns:
        The members taken over, for :func:`restore_members`.  A member whose module no longer holds
        that hook as its only hook (another hook appended, or the hook removed) is left to its own hooks.

    Raises:
        Whatever a member's load raises (a weights map without the value, a read error), after every
        member taken over so far got its placeholders and hooked forward back.
    """
    grad = torch.is_grad_enabled()
    planned = plans is not None and not split
    bypassed: Bypassed = []
    try:
        for member, hook in members:
            state = member.__dict__
            hooked = state.get("forward")
            if state.get("_hf_hook") is not hook or type(hooked) is not HookedForward:
                continue  # its hooks changed since (another hook appended, or removed): they run themselves
            if hook.offload:
                staged = split.get(id(hook)) if split else None
                if staged is not None or not put_in_all_kept(hook, member, grad):
                    try:
                        hook.load_weights(member, staged)
                    except BaseException:
                        hook.unload_weights(member)  # the values it put in before the failure go back
                        raise
            bypassed.append((member, hook, hooked))
            old = state.get("_old_forward")
            if type(old) is WeakBoundMethod:
                del state["forward"]  # the class's forward
            else:
                state["forward"] = old  # a forward set on the instance before hooking
    except BaseException:
        restore_members(bypassed)  # a load that raised: every member taken over so far is given back
        raise
    if planned:
        plans.plan = make_plan(bypassed, len(members))  # type: ignore[union-attr]
    return bypassed


def restore_members(bypassed: Iterable[tuple[nn.Module, Any, Any]]) -> None:
    """Put the placeholders and the hooked forwards of members taken over by :func:`bypass_members` back."""
    if type(bypassed) is PlannedBypass and put_back_plan(bypassed):
        return
    for member, hook, forward in bypassed:
        if hook.offload and not put_back_all_kept(hook, member):
            hook.unload_weights(member)
        member.__dict__["forward"] = forward
