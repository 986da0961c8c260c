"""Attaching device-alignment hooks to a model, and ``align_module_device``.

The hook itself lives in :mod:`bigmodel.hooks.align_hook`; this module decides which module gets
which hook (per module, per block of a device map).  The whole-model hooks of
``cpu_offload_with_hook`` are in :mod:`bigmodel.hooks.cpu_offload`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..core.devices import accelerator_count, accelerator_type, torch_device
from ..core.tensors import named_module_tensors
from .align_hook import AlignDevicesHook, has_offloaded_params, offload_hook_of
from .aligned import align_module_device
from .placeholders import OffloadedParameter
from .registry import ModelHook, add_hook_to_module, iter_hooks, remove_hook_from_module  # noqa: F401

BLOCK_HOOKS_ENV = "BIGMODEL_BLOCK_HOOKS"  # "0": the submodules of an offloaded block run their own hooks

__all__ = [
    "AlignDevicesHook",
    "OffloadedParameter",
    "align_module_device",
    "attach_align_device_hook",
    "attach_align_device_hook_on_blocks",
    "attach_execution_device_hook",
    "has_offloaded_params",
    "tie_offloaded",
    "tie_to_resident",
]


def default_execution_device() -> torch.device:
    """The first accelerator if torch sees one, else the CPU."""
    if accelerator_count() > 0:
        return torch.device(accelerator_type(), 0)  # type: ignore[arg-type]
    return torch.device("cpu")


def _prefixed(weights_map: Mapping[str, torch.Tensor] | None, module_name: str) -> Mapping[str, torch.Tensor] | None:
    if weights_map is None:
        return None
    from ..offload.storage import PrefixedDataset

    return PrefixedDataset(weights_map, f"{module_name}." if module_name else "")


def _is_preloaded(module: nn.Module, preload_module_classes: Sequence[str] | None) -> bool:
    return bool(preload_module_classes) and type(module).__name__ in preload_module_classes  # type: ignore[operator]


def attach_execution_device_hook(
    module: nn.Module,
    execution_device: Any,
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Give every module with tensors, and no hook yet, a hook moving its inputs to ``execution_device``.

    Args:
        module: root of the subtree.
        execution_device: device spec for the inputs.
        skip_keys: input mapping keys never moved.
        preload_module_classes: class names whose subtree is not descended into.
        tied_params_map: shared tied-weights cache (see :class:`AlignDevicesHook`).
    """
    if "_hf_hook" not in module.__dict__ and (module._parameters or module._buffers or _has_tensors(module)):
        hook = AlignDevicesHook(execution_device, skip_keys=skip_keys, tied_params_map=tied_params_map)
        add_hook_to_module(module, hook)
    if _is_preloaded(module, preload_module_classes):
        return
    for child in module.children():
        attach_execution_device_hook(child, execution_device, skip_keys, preload_module_classes, tied_params_map)


def _has_tensors(module: nn.Module) -> bool:
    return next(iter(module.state_dict(keep_vars=True)), None) is not None


def attach_align_device_hook(
    module: nn.Module,
    execution_device: Any = None,
    offload: bool = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach an :class:`AlignDevicesHook` to every module of the subtree that has its own tensors.

    Modules whose class is in ``preload_module_classes`` get one hook for their whole subtree
    (all its weights loaded at the start of their forward).

    Args:
        module: root of the subtree.
        execution_device: where the forwards run.
        offload: offload the weights (kept in ``weights_map``, on ``meta`` between forwards).
        weights_map: Mapping of the whole model's names → values (a prefix is applied per module).
        offload_buffers: offload buffers too.
        module_name: name of ``module`` inside the model (prefix into ``weights_map``).
        skip_keys: input/output mapping keys never moved.
        preload_module_classes: class names loaded as one block.
        tied_params_map: shared tied-weights cache.
    """
    _attach_align(module, execution_device, offload, weights_map, offload_buffers, module_name, skip_keys,
                  preload_module_classes, tied_params_map, set())  # fmt: skip


def _attach_align(
    module: nn.Module, execution_device: Any, offload: bool, weights_map: Mapping[str, torch.Tensor] | None,
    offload_buffers: bool, module_name: str, skip_keys: str | list[str] | None,
    preload_module_classes: list[str] | None, tied_params_map: dict | None, seen: set[int],
) -> None:  # fmt: skip
    """:func:`attach_align_device_hook`; a module registered under several names is hooked once (``seen``)."""
    if id(module) in seen:
        return
    seen.add(id(module))
    has_direct = next(named_module_tensors(module), None) is not None
    full_offload = offload and _is_preloaded(module, preload_module_classes)
    if has_direct or full_offload:
        hook = AlignDevicesHook(
            execution_device=execution_device,
            offload=offload,
            weights_map=_prefixed(weights_map, module_name),
            offload_buffers=offload_buffers,
            place_submodules=full_offload,
            skip_keys=skip_keys,
            tied_params_map=tied_params_map,
        )
        hook.module_name = module_name
        add_hook_to_module(module, hook, append=True)
    if full_offload:
        return
    for child_name, child in module.named_children():
        child_prefix = f"{module_name}.{child_name}" if module_name else child_name
        _attach_align(child, execution_device, offload, weights_map, offload_buffers, child_prefix, skip_keys,
                      preload_module_classes, tied_params_map, seen)  # fmt: skip


@dataclass(frozen=True)
class _BlockPlan:
    """What one block of a device map gets (pure data; :func:`_apply_block` carries it out).

    ``kind``: ``"resident"`` — one hook placing the whole subtree on ``device``; ``"offloaded"`` —
    offloading hooks on every module of the subtree; ``"io"`` — the root is not a block itself
    and only moves inputs/outputs.  ``per_block_map``: the plan comes from a per-block map (the
    block then always carries a hook, and its submodules move their inputs to ``device``).
    """

    name: str
    device: Any
    kind: Literal["resident", "offloaded", "io"]
    io_same_device: bool
    per_block_map: bool


@dataclass(frozen=True)
class _SharedSettings:
    """Settings every block's hooks share."""

    weights_map: Mapping[str, torch.Tensor] | None
    offload_buffers: bool
    skip_keys: str | list[str] | None
    preload_module_classes: list[str] | None
    tied_params_map: dict | None
    seen: set[int]  # modules already given their hooks (a module under several names is hooked once)


def _plan_blocks(
    module: nn.Module, execution_device: Any, offload: Any, module_name: str
) -> list[tuple[nn.Module, _BlockPlan]]:
    """Resolve ``execution_device``/``offload`` (values or per-block dicts) into one plan per block."""
    if not isinstance(execution_device, Mapping) and not isinstance(offload, Mapping):
        kind = "offloaded" if offload else "resident"
        return [(module, _BlockPlan(module_name, execution_device, kind, not offload, per_block_map=False))]
    devices = execution_device if isinstance(execution_device, Mapping) else dict.fromkeys(offload, execution_device)
    offloads = offload if isinstance(offload, Mapping) else dict.fromkeys(devices, offload)
    plans, seen = [], set()
    for name, sub in module.named_modules(prefix=module_name, remove_duplicate=False):
        if id(sub) in seen:
            continue  # a block registered under several names: planned under its first name
        if name in devices and name in offloads:
            seen.add(id(sub))
            kind = "offloaded" if offloads[name] else "resident"
            plans.append((sub, _BlockPlan(name, devices[name], kind, name == "", per_block_map=True)))
        elif name == "":
            plans.append((sub, _BlockPlan("", devices.get(""), "io", True, per_block_map=True)))
    return plans


def _apply_block(module: nn.Module, plan: _BlockPlan, shared: _SharedSettings) -> None:
    """Attach the hooks ``plan`` describes to ``module``."""
    if plan.kind == "io":
        hook = AlignDevicesHook(plan.device, io_same_device=True, skip_keys=shared.skip_keys,
                                tied_params_map=shared.tied_params_map)
        add_hook_to_module(module, hook)
        return
    if plan.kind == "resident":
        hook = AlignDevicesHook(plan.device, io_same_device=plan.io_same_device, offload_buffers=shared.offload_buffers,
                                place_submodules=True, skip_keys=shared.skip_keys,
                                tied_params_map=shared.tied_params_map)
        add_hook_to_module(module, hook, append=True)  # a hook attached before (layerwise casting) stays
    else:
        _attach_align(
            module, plan.device, True, shared.weights_map, shared.offload_buffers, plan.name, shared.skip_keys,
            shared.preload_module_classes, shared.tied_params_map, shared.seen,
        )  # fmt: skip
        if plan.per_block_map:
            _give_block_a_hook(module, plan, shared)
    if plan.per_block_map:
        # preload classes stop the walk only in offloaded blocks (whose weights load at the block's start);
        # a resident block's submodules all move their inputs, as with accelerate 1.15
        preload = shared.preload_module_classes if plan.kind == "offloaded" else None
        attach_execution_device_hook(module, plan.device, shared.skip_keys, preload, shared.tied_params_map)
        if plan.name and os.environ.get(BLOCK_HOOKS_ENV, "1").strip() != "0":
            _gather_members(module, offloaded=plan.kind == "offloaded" and _runs_on_cpu(plan.device))


def _runs_on_cpu(device: Any) -> bool:
    try:
        return torch_device(device).type == "cpu"
    except (TypeError, ValueError):
        return False


def _gather_members(block: nn.Module, offloaded: bool) -> None:
    """Make the block's hook do the work of its submodules' hooks inside the block's forward
    (:meth:`AlignDevicesHook.set_members`): a decode step runs one hook per block, not one per submodule.

    Each submodule keeps its own hook (``_hf_hook``: used when it is called outside the block's
    forward, and read by ``align_module_device``, peft and transformers).  The hooks that only move
    inputs are always taken over.  Offloading hooks only when ``offloaded`` (a block run on the CPU,
    where putting a weight in uses the offloaded value in place, with no copy: the block's weights
    then cost no memory while it runs; on an accelerator each submodule keeps bringing in its own
    weights, as the device keeps room for one offloaded layer).  A submodule with more hooks than
    its AlignDevicesHook (layerwise casting) runs them itself.
    """
    leader = next((hook for hook in iter_hooks(block.__dict__.get("_hf_hook")) if isinstance(hook, AlignDevicesHook)),
                  None)
    if leader is None:
        return
    members = []
    for sub in block.modules():
        hook = sub.__dict__.get("_hf_hook")
        if (sub is not block and type(hook) is AlignDevicesHook and not hook.members  # subclasses run themselves
                and (offloaded or not hook.offload)):
            members.append((sub, hook))
    if members:
        leader.set_members(members)


def _give_block_a_hook(module: nn.Module, plan: _BlockPlan, shared: _SharedSettings) -> None:
    """An offloaded block without tensors of its own still moves its inputs (and the root its outputs)."""
    if "_hf_hook" not in module.__dict__:
        hook = AlignDevicesHook(plan.device, io_same_device=plan.io_same_device, skip_keys=shared.skip_keys,
                                tied_params_map=shared.tied_params_map)
        add_hook_to_module(module, hook)
    elif plan.io_same_device:
        _set_io_same_device(module)


def attach_align_device_hook_on_blocks(
    module: nn.Module,
    execution_device: Any = None,
    offload: bool | Mapping[str, bool] = False,
    weights_map: Mapping[str, torch.Tensor] | None = None,
    offload_buffers: bool = False,
    module_name: str = "",
    skip_keys: str | list[str] | None = None,
    preload_module_classes: list[str] | None = None,
    tied_params_map: dict | None = None,
) -> None:
    """Attach hooks per block of a device map.

    With a single device and ``offload`` bool, the whole module is one block.  With dicts, each
    named block gets either one hook placing its subtree on its device (not offloaded) or
    offloading hooks on every module of its subtree; its submodules move their inputs to its
    device.  The root (``module_name == ""``) also moves outputs back to the input device.

    Inside the forward of a named block (not the root) the block's hook does its submodules'
    hook work for them (they keep their hooks for calls made outside it): moving inputs always,
    and putting offloaded weights in and out when the block runs on the CPU (all of the block's
    weights at the start of its forward).  ``BIGMODEL_BLOCK_HOOKS=0`` at attach time turns this off.

    Args:
        module: the model (or the subtree named ``module_name``).
        execution_device: a device spec, or a dict block name → device spec.
        offload: a bool, or a dict block name → bool (offload that block's weights).
        weights_map, offload_buffers, module_name, skip_keys, preload_module_classes, tied_params_map:
            as in :func:`attach_align_device_hook`.
    """
    shared = _SharedSettings(weights_map, offload_buffers, skip_keys, preload_module_classes, tied_params_map, set())
    for block, plan in _plan_blocks(module, execution_device, offload, module_name):
        _apply_block(block, plan, shared)


def tie_offloaded(model: nn.Module, tied: Sequence[Sequence[str]]) -> list[list[str]]:
    """Make every name of a tied group whose members are all offloaded hold one placeholder.

    Between forwards ``model.lm_head.weight is model.embed.weight`` then holds as on the plain
    model, and what is set on one name (``requires_grad``, dtype) holds for all.

    Args:
        model: the hooked model.
        tied: groups of tied parameter names (:func:`~bigmodel.core.tensors.find_tied_parameters`).

    Returns:
        The groups with a member that is not offloaded (left as they are).
    """
    owners = _offloaded_owners(model)
    rest = []
    for group in tied:
        members = [owners.get(name) for name in group]
        if not all(members):
            rest.append(list(group))
            continue
        first_module, first_hook, first_name = members[0]  # type: ignore[misc]
        shared = first_module.get_parameter(first_name)
        for module, hook, name in members[1:]:  # type: ignore[misc]
            hook.share_placeholder(module, name, shared)
    return rest


def tie_to_resident(model: nn.Module, tied: Sequence[Sequence[str]]) -> None:
    """Offloaded names of a tied group that also has a member held in memory hold that member's Parameter
    (one Parameter, as on the plain model; the value is in memory already), where it is on their
    execution device, in their dtype; other names stay offloaded.

    Args:
        model: the hooked model.
        tied: groups of tied parameter names (groups whose members are all offloaded excluded).
    """
    owners = _offloaded_owners(model)
    for group in tied:
        held = [name for name in group if name not in owners]
        if not held:
            continue
        source = model.get_parameter(held[0])
        if source.is_meta:
            continue
        for name in group:
            if name in owners:
                module, hook, local = owners[name]
                placeholder = module.get_parameter(local)
                if hook.device == source.device and placeholder.dtype == source.dtype:
                    hook.stop_offloading(module, local, source)


def _offloaded_owners(model: nn.Module) -> dict[str, tuple[nn.Module, AlignDevicesHook, str]]:
    """Model-level name of every offloaded tensor → (module of its hook, the hook, name relative to it)."""
    owners: dict[str, tuple[nn.Module, AlignDevicesHook, str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        hook = offload_hook_of(module)
        if hook is not None:
            owners.update((f"{prefix}.{name}" if prefix else name, (module, hook, name)) for name in hook.offloaded_names)
    return owners


def _set_io_same_device(module: nn.Module) -> None:
    hook = offload_hook_of(module)
    if hook is not None:
        hook.io_same_device = True
