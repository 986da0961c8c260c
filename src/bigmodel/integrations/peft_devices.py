"""peft adapters added to an offloaded model keep their values (part of :func:`~bigmodel.use_bigmodel`).

peft puts every new adapter on the device of its base layer's weight
(``_move_adapter_to_device_of_base_layer``, ``_replace_module``: ``module.to(weight.device)``).  An
offloaded weight is a ``meta`` placeholder between forwards, so the adapter would be moved to
``meta`` and its initial values lost (NaN logits, with accelerate as well).  While
:func:`~bigmodel.use_bigmodel` is on, the peft methods of :data:`PEFT_SCOPED` run inside
:func:`~bigmodel.hooks.placeholders.placeholders_report_execution_device`: an offloaded weight then
answers its hook's execution device, and the adapters are created there, in memory, as on a
model without offload (trainable, merged by ``merge_and_unload``).

peft is imported lazily (importing it costs seconds): when it is not imported yet, a finder on
``sys.meta_path`` patches its classes right after ``peft.tuners.tuners_utils`` is first imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..hooks.placeholders import placeholders_report_execution_device

__all__ = ["PEFT_MODULE", "PEFT_SCOPED", "install", "uninstall"]

PEFT_MODULE = "peft.tuners.tuners_utils"
# (class of PEFT_MODULE, method): peft code that places new adapters next to a base layer's weight.
PEFT_SCOPED = (("BaseTuner", "inject_adapter"), ("BaseTunerLayer", "_move_adapter_to_device_of_base_layer"))

Setter = Callable[[Any, str, Any], None]  # records the previous value, so that undoing restores it


def _scoped(method: Callable) -> Callable:
    @functools.wraps(method)
    def run_with_execution_devices(*args: Any, **kwargs: Any) -> Any:
        with placeholders_report_execution_device():
            return method(*args, **kwargs)

    return run_with_execution_devices


def _patch(module: ModuleType, set_attr: Setter) -> None:
    for class_name, method_name in PEFT_SCOPED:
        cls = getattr(module, class_name, None)
        method = vars(cls).get(method_name) if cls is not None else None
        if method is not None:  # another peft version may lack one: nothing to place there
            set_attr(cls, method_name, _scoped(method))


class _Loader(importlib.abc.Loader):
    """The module's own loader, then :func:`_patch` on the module it executed."""

    def __init__(self, loader: Any, set_attr: Setter) -> None:
        self._loader = loader
        self._set_attr = set_attr

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        if _FINDER is not None and _FINDER.loader_setter is self._set_attr:  # still on
            _patch(module, self._set_attr)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename ... (tracebacks, inspect)
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds :data:`PEFT_MODULE` with the other finders and wraps its loader in :class:`_Loader`."""

    def __init__(self, set_attr: Setter) -> None:
        self.loader_setter = set_attr

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != PEFT_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self.loader_setter)
                return spec
        return None


_FINDER: _PatchOnImport | None = None


def install(set_attr: Setter) -> None:
    """Patch peft now if it is imported, else when it is.

    Args:
        set_attr: ``set_attr(owner, name, value)`` sets an attribute and records the old value.
    """
    global _FINDER
    module = sys.modules.get(PEFT_MODULE)
    if module is not None:
        _patch(module, set_attr)
        return
    _FINDER = _PatchOnImport(set_attr)
    sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Stop patching peft on import (the attributes already set are restored by their recorder)."""
    global _FINDER
    if _FINDER is not None and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    _FINDER = None
