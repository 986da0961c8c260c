"""What a dispatch leaves on a model, and undoing it before the next one.

A dispatched model refuses ``.to()``/``.half()``/... while parts are offloaded (their values
live in the weights map and would not follow); dispatching or offloading it again first
removes the earlier hooks, which brings the real weights back into the modules.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from ._align_hook import has_offloaded_params
from ._devices import DeviceSpec, is_accelerator
from ._hook_registry import TIED_PARAMS, patch_attribute, remove_hook_from_submodules
from ._prefetch import enable_prefetch
from ._transfer import DeviceStager

logger = logging.getLogger(__name__)

# Methods that move or cast a whole model; on a model with offloaded parts they are refused.
_MOVE_METHODS = ("to", "cuda", "cpu", "xpu", "npu", "mps", "half", "float", "double", "bfloat16", "type")


def _offloaded_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if has_offloaded_params(module)]


def _guarded_method(ref: weakref.ref, name: str, method: Callable) -> Callable:
    def guarded(*args: Any, **kwargs: Any) -> Any:
        model = ref()
        offloaded = _offloaded_names(model)
        if offloaded:
            shown = ", ".join(repr(n) for n in offloaded[:3]) + (" ..." if len(offloaded) > 3 else "")
            raise RuntimeError(
                f"Cannot call .{name}() on a {type(model).__name__} dispatched with offloaded modules ({shown}): "
                "their weights live in the weights map (CPU/disk) and would not follow. Dispatch it again with "
                "another device map (or dtype), or call bigmodel.remove_hook_from_submodules(model) first, "
                "which brings the weights back into the modules."
            )
        logger.warning(
            "Calling .%s() on a model dispatched over several devices moves every part; its hooks keep the old "
            "execution devices. Re-dispatch the model instead.", name,
        )
        return method(model, *args, **kwargs)

    guarded.__name__ = name
    return guarded


def _guard_moves(model: nn.Module, tied: list[list[str]]) -> None:
    """Refuse .to()/.half()/... on the model while parts are offloaded; remember its ties for removal."""
    patch_attribute(model, TIED_PARAMS, tied)
    ref = weakref.ref(model)
    for name in _MOVE_METHODS:
        method = getattr(type(model), name, None)
        if callable(method):
            patch_attribute(model, name, _guarded_method(ref, name, method))


def _runs_on_accelerator(device: DeviceSpec | None) -> bool:
    """True when forwards run on an accelerator: CPU-held weights are then pinned once, and
    offloaded values reach the device through :class:`~bigmodel._transfer.DeviceStager`
    (side-stream copies; disk values through its pinned staging buffer)."""
    return device is not None and device != "disk" and is_accelerator(device)


def _enable_prefetch(model: nn.Module, device: DeviceSpec) -> None:
    """Prefetch for ``model``'s offloading hooks, staging to the device when it is an accelerator."""
    enable_prefetch(model, stage=DeviceStager() if _runs_on_accelerator(device) else None)


def _is_dispatched(model: nn.Module) -> bool:
    """True if ``model`` carries hooks from an earlier dispatch/offload (its weights may be placeholders)."""
    return TIED_PARAMS in model.__dict__ or any(has_offloaded_params(m) for m in model.modules())


def _undispatch(model: nn.Module, what: str) -> None:
    """Remove the hooks of an earlier dispatch/offload, bringing the real weights back into ``model``."""
    if _is_dispatched(model):
        logger.info("%s: the model was already dispatched; removing its hooks (weights come back) first.", what)
        remove_hook_from_submodules(model)
