"""Run the big-model paths of transformers, diffusers and peft on bigmodel: :func:`use_bigmodel`.

Those libraries reach the big-model API through accelerate (``from accelerate import
dispatch_model``, ``accelerate.hooks.AlignDevicesHook`` ...).  While :func:`use_bigmodel` is
on, two things hold:

1. the names of :data:`PATCH_TABLE` on accelerate's own modules are bigmodel's objects of the
   same names, so code that imports them later (or looks them up at call time, as diffusers'
   ``enable_model_cpu_offload`` does) gets bigmodel's;
2. every binding of those same accelerate objects that transformers, diffusers or peft
   modules already hold (found by identity, so renamed imports such as transformers'
   ``accelerate_max_memory`` count) points to bigmodel's object;
3. peft creates the adapters it adds to an offloaded layer on that layer's execution device
   (not on ``meta``, where they would lose their values): :mod:`~bigmodel.integrations.peft_devices`.

Undoing it puts every replaced attribute back (and turns bindings made while it was on back
into accelerate's).  Nothing is written to any file.  accelerate stays installed and in charge
of everything outside the big-model API (``Accelerator``, ``PartialState``, training,
``send_to_device`` ...).  transformers 5 plans device maps and reads checkpoints with its own
code; with the integration on, it dispatches and offloads with bigmodel.

This is the only module of bigmodel that imports accelerate, and only when it is switched on.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any

from .._exports import resolve
from ..dispatch.dispatch import CHECK_DEVICE_MAP_SITES
from . import peft_devices

__all__ = ["CONSUMERS", "PATCH_TABLE", "BigmodelPatch", "is_active", "use_bigmodel"]

logger = logging.getLogger(__name__)

_BIG_MODELING = ("init_empty_weights", "init_on_device", "cpu_offload", "cpu_offload_with_hook", "disk_offload",
                 "dispatch_model", "load_checkpoint_and_dispatch", "infer_auto_device_map", "load_checkpoint_in_model")
_HOOKS = ("ModelHook", "SequentialHook", "add_hook_to_module", "remove_hook_from_module",
          "remove_hook_from_submodules", "AlignDevicesHook", "CpuOffload", "UserCpuOffloadHook",
          "attach_execution_device_hook", "attach_align_device_hook", "attach_align_device_hook_on_blocks")
_TENSORS = ("set_module_tensor_to_device", "named_module_tensors")
_OFFLOAD = ("offload_weight", "offload_state_dict", "save_offload_index", "load_offloaded_weight",
            "OffloadedWeightsLoader", "PrefixedDataset", "extract_submodules_state_dict")
_PLANNING = ("get_max_memory", "get_balanced_memory", "compute_module_sizes", "get_max_layer_size",
             "check_device_map", "infer_auto_device_map", "load_checkpoint_in_model")
_OFFLOADED = ("load_offloaded_weights", "has_offloaded_params", "align_module_device")

# accelerate module → the names replaced there by bigmodel's objects of the same names (accelerate 1.15).
PATCH_TABLE: dict[str, tuple[str, ...]] = {
    "accelerate": _BIG_MODELING,
    "accelerate.big_modeling": _BIG_MODELING + ("get_balanced_memory", "check_device_map", "offload_state_dict",
                                                "OffloadedWeightsLoader", "extract_submodules_state_dict",
                                                "add_hook_to_module", "AlignDevicesHook", "CpuOffload",
                                                "UserCpuOffloadHook", "attach_align_device_hook",
                                                "attach_align_device_hook_on_blocks"),
    "accelerate.hooks": _HOOKS + _TENSORS + ("PrefixedDataset",),
    "accelerate.utils": _PLANNING + _TENSORS + _OFFLOAD + _OFFLOADED,
    "accelerate.utils.modeling": _PLANNING + _TENSORS + _OFFLOADED + ("clean_device_map", "offload_weight",
                                                                     "save_offload_index", "load_offloaded_weight",
                                                                     "get_state_dict_offloaded_model"),
    "accelerate.utils.offload": _OFFLOAD,
}  # fmt: skip

# bigmodel hook classes that accelerate lacks: peft and diffusers rebuild a hook through
# ``getattr(accelerate.hooks, type(hook).__name__)``, so they are added there while on.
_EXTRA_HOOK_CLASSES = {"PinnedCpuOffload": "bigmodel.hooks.cpu_offload"}

# Packages whose already-imported modules get their accelerate bindings swapped.
CONSUMERS = ("transformers", "diffusers", "peft")

_ABSENT = object()


@dataclass
class _State:
    holders: int = 0
    saved: list[tuple[Any, str, Any, Any]] = field(default_factory=list)  # module/class, name, before, ours
    swaps: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(accelerate's) → (accelerate's, ours)


_LOCK = threading.RLock()
_STATE = _State()


class BigmodelPatch:
    """What :func:`use_bigmodel` returns: ``undo()`` (or the end of a ``with`` block) switches it off.

    Several handles may be on at once (nested ``with`` blocks, libraries that each call
    :func:`use_bigmodel`); accelerate is put back when the last one is undone.  Undoing a
    handle twice does nothing.
    """

    def __init__(self) -> None:
        self._active = True

    @property
    def active(self) -> bool:
        """True until :meth:`undo`."""
        return self._active

    def undo(self) -> None:
        """Switch this handle off; the last handle off restores every patched attribute."""
        with _LOCK:
            if not self._active:
                return
            self._active = False
            _STATE.holders -= 1
            if _STATE.holders == 0:
                _uninstall()

    def __enter__(self) -> BigmodelPatch:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.undo()


def use_bigmodel() -> BigmodelPatch:
    """Make transformers, diffusers and peft place, offload and dispatch with bigmodel.

    Call it before or after importing those libraries; use the returned handle as a context
    manager, or call its ``undo()``, to go back to accelerate.  Models dispatched while it was
    on keep bigmodel's hooks after it is undone (remove them with
    ``remove_hook_from_submodules``).

    Example::

        import bigmodel
        from transformers import AutoModelForCausalLM

        with bigmodel.use_bigmodel():
            model = AutoModelForCausalLM.from_pretrained(path, device_map="auto",
                                                         max_memory={"cpu": "8GiB"}, offload_folder="off")

    Returns:
        A :class:`BigmodelPatch` handle (also a context manager).

    Raises:
        ImportError: accelerate is not installed (transformers, diffusers and peft need it to
            accept a device map at all): ``pip install accelerate``.
    """
    with _LOCK:
        if _STATE.holders == 0:
            try:
                _install()
            except BaseException:
                _uninstall()  # a failed switch-on leaves nothing behind
                raise
        _STATE.holders += 1
    return BigmodelPatch()


def is_active() -> bool:
    """True while at least one :func:`use_bigmodel` handle is on."""
    return _STATE.holders > 0


def _import(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ImportError(
            f"use_bigmodel() needs {name!r}: transformers, diffusers and peft accept a device map only when "
            "accelerate is installed. Install it with `pip install accelerate` (bigmodel is tested with 1.15.0)."
        ) from err


def _set(module: Any, name: str, value: Any) -> None:
    _STATE.saved.append((module, name, vars(module).get(name, _ABSENT), value))
    setattr(module, name, value)


def _consumer_modules() -> list[ModuleType]:
    return [
        module
        for name, module in list(sys.modules.items())
        if name.partition(".")[0] in CONSUMERS and isinstance(module, ModuleType)
    ]


def _install() -> None:
    """Replace the table's names on accelerate's modules, then the consumers' bindings of them."""
    for module_name, names in PATCH_TABLE.items():
        module = _import(module_name)
        for name in names:
            original = vars(module).get(name, _ABSENT)
            if original is _ABSENT:
                logger.debug("%s has no %s (another accelerate version); not patched.", module_name, name)
                continue
            replacement = resolve(name)
            _STATE.swaps.setdefault(id(original), (original, replacement))
            _set(module, name, replacement)
    hooks = _import("accelerate.hooks")
    for name, home in _EXTRA_HOOK_CLASSES.items():
        _set(hooks, name, getattr(importlib.import_module(home), name))
    swapped = _swap_bindings(dict(_STATE.swaps), record=True)
    peft_devices.install(_set)  # adapters added to offloaded layers are created on the execution device
    CHECK_DEVICE_MAP_SITES.append("accelerate.big_modeling")
    logger.info("use_bigmodel: accelerate's big-model API now runs on bigmodel (%d bindings swapped).", swapped)


def _swap_bindings(swaps: dict[int, tuple[Any, Any]], record: bool) -> int:
    """In every consumer module, rebind attributes that are ``swaps``' first objects to the second ones."""
    count = 0
    for module in _consumer_modules():
        for name, value in list(vars(module).items()):
            pair = swaps.get(id(value))
            if pair is not None and pair[0] is value:
                if record:
                    _set(module, name, pair[1])
                else:
                    setattr(module, name, pair[1])
                count += 1
    return count


def _uninstall() -> None:
    """Put back what :func:`_install` replaced; rebind what consumers imported meanwhile."""
    peft_devices.uninstall()
    if "accelerate.big_modeling" in CHECK_DEVICE_MAP_SITES:
        CHECK_DEVICE_MAP_SITES.remove("accelerate.big_modeling")
    for module, name, before, ours in reversed(_STATE.saved):
        if vars(module).get(name, _ABSENT) is not ours:
            logger.warning("%s.%s was replaced again after use_bigmodel(); leaving it as it is.", module.__name__, name)
        elif before is _ABSENT:
            delattr(module, name)
        else:
            setattr(module, name, before)
    # Modules imported while on took bigmodel's objects from accelerate's patched modules.
    _swap_bindings({id(ours): (ours, original) for original, ours in _STATE.swaps.values()}, record=False)
    _STATE.saved.clear()
    _STATE.swaps.clear()
    logger.info("use_bigmodel undone: accelerate's big-model API is accelerate's again.")
