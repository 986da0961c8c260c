"""peft adapters added to an offloaded model keep their values (part of :func:`~bigmodel.use_bigmodel`).

peft puts every new adapter on the device of its base layer's weight
(``_move_adapter_to_device_of_base_layer``, ``_replace_module``: ``module.to(weight.device)``).  An
offloaded weight is a ``meta`` placeholder between forwards, so the adapter would be moved to
``meta`` and its initial values lost (NaN logits, with accelerate as well).  While
:func:`~bigmodel.use_bigmodel` is on, the peft methods of :data:`PEFT_SCOPED` run inside
:func:`~bigmodel.hooks.placeholders.placeholders_report_execution_device`: an offloaded weight then
answers its hook's execution device, and the adapters are created there, in memory, as on a
model without offload (trainable, merged by ``merge_and_unload``).

Merging (``merge_and_unload``, ``unload``, ``merge_adapter``) runs each layer inside peft's
``onload_layer``, which looks up the safetensors file of the first entry of a disk-offloaded base
layer's offload index, for a result it never uses (its weights map is a ``dict`` by the time it
would be).  An index entry of a ``.dat`` file names no such file (a ``.bin`` checkpoint, a dtype
conversion): ``KeyError: 'safetensors_file'``, with accelerate as well; an ``offload_quantization``
weights map has no index (``AttributeError``).  While
:func:`~bigmodel.use_bigmodel` is on, such a layer goes through :func:`onload_without_file_lookup`,
peft's steps without the lookup; every other layer through peft's own ``onload_layer``.

peft is imported lazily (importing it costs seconds): when it is not imported yet, a finder on
``sys.meta_path`` patches its classes right after ``peft.tuners.tuners_utils`` is first imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from ..core.tensors import named_module_tensors
from ..hooks.align_hook import AlignDevicesHook
from ..hooks.placeholders import placeholders_report_execution_device

__all__ = ["PEFT_MODULE", "PEFT_SCOPED", "install", "uninstall"]

PEFT_MODULE = "peft.tuners.tuners_utils"
# (class of PEFT_MODULE, method): peft code that places new adapters next to a base layer's weight.
PEFT_SCOPED = (("BaseTuner", "inject_adapter"), ("BaseTunerLayer", "_move_adapter_to_device_of_base_layer"))
PEFT_ONLOAD = "onload_layer"  # function of PEFT_MODULE that merging and unloading run each layer in

Setter = Callable[[Any, str, Any], None]  # records the previous value, so that undoing restores it


def _scoped(method: Callable) -> Callable:
    @functools.wraps(method)
    def run_with_execution_devices(*args: Any, **kwargs: Any) -> Any:
        with placeholders_report_execution_device():
            return method(*args, **kwargs)

    return run_with_execution_devices


def _offloading(module: nn.Module | None) -> bool:
    """True if ``module``'s hook puts offloaded weights in (peft's test: an AlignDevicesHook with ``offload``)."""
    hook = getattr(module, "_hf_hook", None)
    return isinstance(hook, AlignDevicesHook) and bool(hook.offload)


def names_a_file(layer: nn.Module) -> bool:
    """False where peft's ``onload_layer`` would look up a safetensors file that the disk offload index of
    ``layer.base_layer`` does not name (the index entry of its first tensor is a ``.dat`` file's), or the
    weights map's dataset has no index at all (``offload_quantization``)."""
    base = getattr(layer, "base_layer", None)
    if not _offloading(base):
        return True
    dataset = getattr(base._hf_hook.weights_map, "dataset", None)
    if dataset is None:
        return True  # peft looks nothing up
    index = getattr(dataset, "index", None)
    if not isinstance(index, Mapping):
        return False
    first = next(iter(dataset), None)  # the entry peft asks about: the first the dataset iterates
    return first is None or "safetensors_file" in (index.get(first) or {})


@contextlib.contextmanager
def onload_without_file_lookup(layer: nn.Module) -> Iterator[None]:
    """peft's ``onload_layer`` (0.21) without the file name lookup: offloaded submodules' weights in, the base
    layer's in; after the body (the merge), the base layer's weights map becomes its merged tensors."""
    others = [m for name, m in layer.named_modules() if name not in ("", "base_layer") and _offloading(m)]
    for module in others:
        module._hf_hook.pre_forward(module)
    base = getattr(layer, "base_layer", None)
    base_offloaded = _offloading(base)
    if base_offloaded:
        base._hf_hook.pre_forward(base)
    yield
    for module in others:
        module._hf_hook.post_forward(module, torch.tensor([]))
    if base_offloaded:
        base._hf_hook.weights_map = {name: tensor.to("cpu") for name, tensor in named_module_tensors(base)}
        base._hf_hook.post_forward(base, torch.tensor([]))


def _onload(original: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
    @functools.wraps(original)
    def onload_layer(layer: nn.Module) -> Any:
        return original(layer) if names_a_file(layer) else onload_without_file_lookup(layer)

    return onload_layer


def _patch(module: ModuleType, set_attr: Setter) -> None:
    for class_name, method_name in PEFT_SCOPED:
        cls = getattr(module, class_name, None)
        method = vars(cls).get(method_name) if cls is not None else None
        if method is not None:  # another peft version may lack one: nothing to place there
            set_attr(cls, method_name, _scoped(method))
    onload = vars(module).get(PEFT_ONLOAD)
    if callable(onload):
        set_attr(module, PEFT_ONLOAD, _onload(onload))


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
