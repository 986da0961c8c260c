"""The callables a hook patches onto a module: the hooked ``forward`` and the ``_old_forward`` it calls.

Both reach their module through a weak reference (a hooked module is in no reference cycle)
and read everything else when called, never at attach time:

- :class:`WeakBoundMethod` (``_old_forward`` of a module whose forward is its class's) looks the
  class forward up at each call, so a ``torch.fx.GraphModule`` edited and ``recompile()``-d
  after hooking runs its new code;
- :class:`HookedForward` (``module.forward``) runs ``module._hf_hook`` around
  ``module._old_forward`` and reports the signature, name and docstring of
  ``module._old_forward`` (a forward set on the instance keeps its own signature).

``copy.deepcopy`` of a hooked module gives callables bound to the copy (a copy runs as itself).
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["HookedForward", "ModuleBound", "WeakBoundMethod"]


class ModuleBound:
    """Base of a callable bound to a module through a weak reference; deep copies follow the module.

    Args:
        module: the module.
    """

    __slots__ = ("__weakref__", "_ref")

    def __init__(self, module: nn.Module) -> None:
        self._ref = weakref.ref(module)

    @property
    def module(self) -> nn.Module | None:
        """The module (None once it was freed)."""
        return self._ref()

    def __deepcopy__(self, memo: dict) -> ModuleBound:
        # copy.deepcopy registers a module's copy in memo before copying its __dict__ (where this lives).
        module = self._ref()
        clone = memo.get(id(module)) if module is not None else None
        return self if clone is None else type(self)(clone)

    def __copy__(self) -> ModuleBound:
        return self


_FUNCTION_METADATA = frozenset({"__code__", "__defaults__", "__kwdefaults__", "__annotations__", "__globals__"})
"""Attributes of a forward function its hooked stand-ins answer (torch.export reads ``forward.__code__``)."""


class _OfFunction:
    """An attribute of a :class:`WeakBoundMethod` read from its function (on the class: ``default``)."""

    def __init__(self, name: str, default: Any = None) -> None:
        self.name, self.default = name, default

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self.default
        module = obj._ref()
        if module is None:  # freed: no function to ask (every object has a __doc__)
            if self.name == "__doc__":
                return None
            raise AttributeError(self.name)
        return getattr(type(module).forward, self.name)


class WeakBoundMethod(ModuleBound):
    """``type(module).forward`` bound to ``module``, looked up at each call.

    Like the bound method it stands for, it has the function's ``__name__``, ``__qualname__`` and
    ``__doc__``, and compares (and hashes) equal to ``module.forward`` as bound before hooking.
    """

    __slots__ = ()
    __doc__ = _OfFunction("__doc__", __doc__)  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # only reached for names the class does not define
        # As a bound method's, the function's name and code (never its __dict__: torch.compile guards on it).
        if name in ("__name__", "__qualname__") or name in _FUNCTION_METADATA:
            return _OfFunction(name).__get__(self)
        raise AttributeError(name)

    def _bound(self) -> Any:
        """The equivalent bound method (None once the module was freed)."""
        module = self._ref()
        return None if module is None else type(module).forward.__get__(module)

    def __eq__(self, other: object) -> bool:
        mine = self._bound()
        theirs = other._bound() if isinstance(other, WeakBoundMethod) else other
        if mine is None or theirs is None:
            return self is other
        return mine == theirs

    def __hash__(self) -> int:
        mine = self._bound()
        return object.__hash__(self) if mine is None else hash(mine)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._ref()
        return type(module).forward(module, *args, **kwargs)

    @property
    def __self__(self) -> nn.Module | None:
        return self._ref()

    @property
    def __func__(self) -> Callable:
        return type(self._ref()).forward

    @property
    def __signature__(self) -> inspect.Signature:
        module = self._ref()
        try:
            return inspect.signature(type(module).forward.__get__(module))
        except (TypeError, ValueError) as err:  # inspect then falls back to (*args, **kwargs)
            raise AttributeError("__signature__") from err


def _eager(fn: Callable) -> Callable:
    """``fn`` excluded from torch.compile tracing (hooks move tensors and mutate modules)."""
    try:
        return torch.compiler.disable(fn, recursive=True)
    except Exception:  # pragma: no cover - very old torch without torch.compiler
        return fn


def _call_pre(hook: Any, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return hook.pre_forward(module, *args, **kwargs)


def _call_post(hook: Any, module: nn.Module, output: Any) -> Any:
    return hook.post_forward(module, output)


_EAGER: dict[str, Callable] = {}


def _eager_calls() -> tuple[Callable, Callable]:
    if not _EAGER:
        _EAGER["pre"] = _eager(_call_pre)
        _EAGER["post"] = _eager(_call_post)
    return _EAGER["pre"], _EAGER["post"]


def _run_hooked(hook: Any, mod: nn.Module, call_pre: Callable, call_post: Callable, args: tuple, kwargs: dict) -> Any:
    """``pre_forward`` → the original forward (under ``no_grad`` if the hook asks) → ``post_forward``."""
    args, kwargs = call_pre(hook, mod, args, kwargs)
    if hook.no_grad:
        with torch.no_grad():
            output = mod._old_forward(*args, **kwargs)
    else:
        output = mod._old_forward(*args, **kwargs)
    return call_post(hook, mod, output)


def _forward_failed(hook: Any, mod: nn.Module) -> None:
    """After an exception in a hooked forward, let hooks that hold resources release them.

    A hook may define ``forward_failed(module)`` (e.g. an offloading hook sends the weights
    it loaded back to ``meta``, so a failed forward does not leak them).  Errors raised
    while cleaning up are logged, never raised over the forward's own exception.
    """
    from .registry import iter_hooks  # the registry imports this module

    for inner in iter_hooks(hook):
        cleanup = getattr(inner, "forward_failed", None)
        if cleanup is None:
            continue
        try:
            cleanup(mod)
        except Exception:
            logger.exception("Cleaning up %s after a failed forward failed too.", type(inner).__name__)


class HookedForward(ModuleBound):
    """``module.forward`` of a hooked module: ``_hf_hook.pre_forward`` → ``_old_forward`` → ``post_forward``.

    ``inspect.signature``, ``__name__``, ``__qualname__`` and ``__doc__`` are those of ``module._old_forward``,
    and ``__wrapped__`` is ``module._old_forward``, as for accelerate's ``functools.update_wrapper``-ed
    forward (transformers reads ``inspect.signature(model.forward)`` to filter ``generate()`` kwargs).
    """

    __slots__ = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        mod = self._ref()
        hook = mod._hf_hook
        # Under torch.compile the hooks run eagerly (graph break).
        if torch.compiler.is_compiling():
            return _run_hooked(hook, mod, *_eager_calls(), args, kwargs)
        try:  # _run_hooked with the eager calls inlined (this runs once per module per forward)
            args, kwargs = hook.pre_forward(mod, *args, **kwargs)
            if hook.no_grad:
                with torch.no_grad():
                    output = mod._old_forward(*args, **kwargs)
            else:
                output = mod._old_forward(*args, **kwargs)
            return hook.post_forward(mod, output)
        except BaseException:
            _forward_failed(hook, mod)
            raise

    def _wrapped(self) -> Callable | None:
        module = self._ref()
        return None if module is None else module.__dict__.get("_old_forward")

    @property
    def __signature__(self) -> inspect.Signature:
        try:
            return inspect.signature(self._wrapped())  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:  # inspect then falls back to (*args, **kwargs)
            raise AttributeError("__signature__") from err

    @property
    def __wrapped__(self) -> Callable:
        """``module._old_forward`` (what ``inspect.unwrap`` and ``functools.wraps`` readers follow)."""
        wrapped = self._wrapped()
        if wrapped is None:
            raise AttributeError("__wrapped__")
        return wrapped

    def __getattr__(self, name: str) -> Any:  # only reached for names the class does not define
        if name == "__qualname__":  # a class body cannot define it as a property
            return getattr(self._wrapped(), "__qualname__", "forward")
        if name in _FUNCTION_METADATA:  # torch.export reads forward.__code__
            return getattr(self._wrapped(), name)
        raise AttributeError(name)

    @property
    def __name__(self) -> str:  # type: ignore[override]
        return getattr(self._wrapped(), "__name__", "forward")

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        return getattr(self._wrapped(), "__doc__", None)
