"""The hook mechanism: ``ModelHook``, ``SequentialHook`` and attaching them to modules.

A hooked module keeps two attributes other libraries read: ``module._hf_hook`` (the hook)
and ``module._old_forward`` (the forward it had before).  ``module.forward`` becomes a
:class:`~bigmodel.hooks.forward.HookedForward` that runs ``hook.pre_forward``, the old forward
and ``hook.post_forward``.

Everything this module patches onto a module instance is recorded in
``module._bigmodel_patches`` (attribute name → previous instance value, or "absent"), so
:func:`remove_hook_from_module` restores exactly what was there.  The patched forward holds
its module through a weak reference: a hooked module is not part of a reference cycle,
and ``del model`` frees its memory at once, without waiting for ``gc.collect()``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from .forward import HookedForward, WeakBoundMethod

logger = logging.getLogger(__name__)


class _Absent:
    """Marks "the instance had no such attribute" in a patch record (one object, also in deep copies)."""

    def __deepcopy__(self, memo: dict) -> _Absent:
        return self

    def __reduce__(self) -> str:
        return "_ABSENT"

    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()
_PATCHES = "_bigmodel_patches"


class ModelHook:
    """Base class of hooks run around a module's forward.

    Subclasses override any of the four methods.  ``no_grad = True`` runs the module's
    forward under :func:`torch.no_grad`.  ``runs_innermost = True`` keeps the hook next to the
    forward when hooks are chained: hooks appended after it run before it (layerwise casting
    casts up the weights an offloading hook has just put in, whichever was attached first).
    """

    no_grad = False
    runs_innermost = False

    def init_hook(self, module: nn.Module) -> nn.Module:
        """Called once when the hook is attached; returns the module (possibly changed)."""
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """Called before the forward; returns the ``(args, kwargs)`` the forward receives."""
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        """Called after the forward; returns what the module call returns."""
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        """Called when the hook is removed; undoes what :meth:`init_hook` changed."""
        return module


class SequentialHook(ModelHook):
    """Several hooks run in order (``pre_forward`` first to last, ``post_forward`` too).

    ``hooks`` is a tuple, as accelerate's.  ``no_grad`` is True when one of the hooks asks for it,
    unless set on the SequentialHook itself (``module._hf_hook.no_grad = True``), which then wins.

    Args:
        *hooks: the hooks, in the order they run.
    """

    def __init__(self, *hooks: ModelHook) -> None:
        self.hooks = hooks

    @property
    def no_grad(self) -> bool:  # type: ignore[override]
        """The value set on this hook, else whether any of its hooks runs the forward without grad."""
        if "_no_grad" in self.__dict__:
            return self.__dict__["_no_grad"]
        return any(getattr(hook, "no_grad", False) for hook in self.hooks)

    @no_grad.setter
    def no_grad(self, value: bool) -> None:
        self.__dict__["_no_grad"] = value

    @no_grad.deleter
    def no_grad(self) -> None:
        self.__dict__.pop("_no_grad", None)

    def init_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:
            module = hook.init_hook(module)
        return module

    def pre_forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        for hook in self.hooks:
            args, kwargs = hook.pre_forward(module, *args, **kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        for hook in self.hooks:
            output = hook.post_forward(module, output)
        return output

    def detach_hook(self, module: nn.Module) -> nn.Module:
        for hook in self.hooks:  # in order, as pre_forward: an offloading hook puts the weights back first
            module = hook.detach_hook(module)
        return module


def iter_hooks(hook: ModelHook | None) -> list[ModelHook]:
    """The hooks inside ``hook`` (itself, or the members of a SequentialHook, flattened)."""
    if hook is None:
        return []
    if isinstance(hook, SequentialHook):
        return [inner for member in hook.hooks for inner in iter_hooks(member)]
    return [hook]


# --- recorded instance patches --------------------------------------------------------


def patch_attribute(module: nn.Module, name: str, value: Any) -> None:
    """Set ``module.<name> = value`` on the instance, recording the previous instance value once."""
    record = module.__dict__.get(_PATCHES)
    if record is None:
        record = {}
        object.__setattr__(module, _PATCHES, record)
    if name not in record:
        record[name] = module.__dict__.get(name, _ABSENT)
    object.__setattr__(module, name, value)


def restore_attribute(module: nn.Module, name: str) -> None:
    """Undo :func:`patch_attribute` for ``name`` (no-op if it was not patched)."""
    record = module.__dict__.get(_PATCHES)
    if not record or name not in record:
        return
    previous = record.pop(name)
    if previous is _ABSENT:
        module.__dict__.pop(name, None)
    else:
        object.__setattr__(module, name, previous)
    if not record:
        del module.__dict__[_PATCHES]


def is_patched(module: nn.Module, name: str) -> bool:
    """True if :func:`patch_attribute` replaced ``name`` on this module."""
    return name in (module.__dict__.get(_PATCHES) or {})


def _init(hook: ModelHook, module: nn.Module) -> nn.Module:
    """``hook.init_hook(module)``; what it builds (weights maps, moved or pinned copies) outlives any
    forward, so it is never made of inference tensors, even inside ``torch.inference_mode()``."""
    with torch.inference_mode(False):
        return hook.init_hook(module)


def _innermost_last(hooks: list[ModelHook]) -> list[ModelHook]:
    """``hooks`` in order, those with ``runs_innermost`` moved to the end (in their order)."""
    inner = [hook for hook in hooks if getattr(hook, "runs_innermost", False)]
    return [hook for hook in hooks if hook not in inner] + inner


def _rewrap_forward(module: nn.Module) -> None:
    """Make ``module.forward`` the hooked forward again if something replaced it after hooking.

    As with accelerate, hooking an already hooked module wraps ``module._old_forward``: a forward
    assigned to the hooked module in between is dropped (before, the new hook never ran).
    """
    forward = module.__dict__.get("forward")
    if type(forward) is not HookedForward or forward.module is not module:
        logger.debug("%s.forward was replaced after hooking; the new hook wraps _old_forward.", type(module).__name__)
        patch_attribute(module, "forward", HookedForward(module))


def add_hook_to_module(module: nn.Module, hook: ModelHook, append: bool = False) -> nn.Module:
    """Attach ``hook`` to ``module``: its forward now runs through the hook.

    Args:
        module: the module to hook.
        hook: the hook.  ``hook.init_hook(module)`` runs now.
        append: if the module already has a hook, chain the new one after it in a
            :class:`SequentialHook` instead of replacing it (before the hooks whose
            ``runs_innermost`` is set, which stay next to the forward).

    Returns:
        The module, with ``_hf_hook`` and ``_old_forward`` set.
    """
    existing = module.__dict__.get("_hf_hook")
    if "_old_forward" in module.__dict__ and existing is not None:
        module = _init(hook, module)
        if append:
            hook = SequentialHook(*_innermost_last([*iter_hooks(existing), hook]))
        patch_attribute(module, "_hf_hook", hook)
        _rewrap_forward(module)
        return module

    if "forward" in module.__dict__:
        old_forward = module.__dict__["forward"]  # an instance-level forward someone set: keep it as is
    else:
        old_forward = WeakBoundMethod(module)
    module = _init(hook, module)
    patch_attribute(module, "_hf_hook", hook)
    patch_attribute(module, "_old_forward", old_forward)
    patch_attribute(module, "forward", HookedForward(module))
    return module


def remove_hook_from_module(module: nn.Module, recurse: bool = False) -> nn.Module:
    """Detach the hook of ``module`` and restore its original forward.

    Args:
        module: the hooked module (a module without a hook is left as is).
        recurse: also remove the hooks of all submodules.

    Returns:
        The module.
    """
    hook = module.__dict__.get("_hf_hook")
    if hook is not None:
        hook.detach_hook(module)
    old_forward = module.__dict__.get("_old_forward")
    record = module.__dict__.get(_PATCHES) or {}
    if old_forward is not None and not isinstance(old_forward, WeakBoundMethod) and "_old_forward" in record:
        # Someone replaced _old_forward after we hooked: keep their forward, as the convention says.
        if record["_old_forward"] is not old_forward:
            record["forward"] = old_forward
    for name in list(record):
        restore_attribute(module, name)
    for name in ("_hf_hook", "_old_forward"):
        module.__dict__.pop(name, None)
    if recurse:
        for child in module.children():
            remove_hook_from_module(child, recurse=True)
    return module


TIED_PARAMS = "_bigmodel_tied_params"  # tied groups recorded by dispatch, re-tied when hooks are removed


def remove_hook_from_submodules(module: nn.Module) -> None:
    """Remove the hooks of every submodule of ``module`` (recursively) and of ``module`` itself.

    Offloaded weights come back into the modules; weights that were tied when the model
    was dispatched are tied again.
    """
    tied = module.__dict__.get(TIED_PARAMS)
    for child in module.children():
        remove_hook_from_module(child, recurse=True)
    remove_hook_from_module(module)
    if tied:
        from ..core.tensors import retie_parameters

        retie_parameters(module, tied)
