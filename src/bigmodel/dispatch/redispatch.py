"""What a dispatch leaves on a model, and undoing it before the next one.

A dispatched model refuses device moves (``.to(device)``, ``.cpu()``, ``to_empty()``..., through a
guard on ``Module._apply``) while parts are offloaded: their values live in the weights map and
would not follow.  Casts (``.to(dtype)``, ``.half()``, ``.to(memory_format=...)``) go through.  Dispatching or offloading it again first removes the earlier hooks, which brings
the real weights back into the modules.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..core.devices import DeviceSpec, is_accelerator
from ..hooks.align_hook import has_offloaded_params
from ..hooks.forward import ModuleBound
from ..hooks.placeholders import placeholders_stay_meta
from ..hooks.registry import TIED_PARAMS, iter_hooks, patch_attribute, remove_hook_from_submodules
from ..offload.resident import read_resident
from ..transfer.copies import DeviceStager
from .prefetch_setup import enable_prefetch

logger = logging.getLogger(__name__)


def _offloaded_names(model: nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if has_offloaded_params(module)]


def _execution_devices(model: nn.Module) -> list[str]:
    """The execution devices of ``model``'s hooks, each once, quoted, in module order."""
    devices: dict[str, None] = {}
    for module in model.modules():
        for hook in iter_hooks(module.__dict__.get("_hf_hook")):
            device = getattr(hook, "execution_device", None)
            if device is not None:
                devices[repr(str(device))] = None
    return list(devices)


def _caller_name() -> str:
    """The public method that led to ``_apply`` (``to``, ``half``, ...), read from the stack."""
    frame = sys._getframe(2)  # 0: here, 1: the guard, 2: its caller
    while frame is not None and frame.f_code.co_name in ("_apply", "__call__"):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "_apply"


def keeps_devices(fn: Callable[[torch.Tensor], Any]) -> bool:
    """True if ``fn`` (what ``Module._apply`` applies to each tensor) keeps every tensor on its device.

    Asked of two 4-d float32 probes, one on ``meta`` and one on the CPU: a cast (``.to(dtype)``,
    ``.double()``, ``.to(memory_format=...)``) leaves both where they are; any device move changes
    one of them or raises (a copy out of ``meta``).
    """
    for device in ("meta", "cpu"):
        probe = torch.zeros((1, 1, 1, 1), device=device)
        try:
            with torch.no_grad():
                out = fn(probe)
        except Exception:
            return False
        if not isinstance(out, torch.Tensor) or out.device.type != device:
            return False
    return True


# The first sentence of the warning for a device move of a dispatched model, in accelerate 1.15's words.
INCUMBENT_MOVE_WARNING = "You shouldn't move a model that is dispatched using accelerate hooks."


class GuardedApply(ModuleBound):
    """``model._apply`` of a dispatched model: casts go through, device moves are refused while parts are offloaded.

    A cast (no device changes) converts the resident tensors as usual and the placeholders of the
    offloaded ones on ``meta`` (nothing is read); the hooks cast each value to its placeholder's
    dtype when they load it.
    """

    __slots__ = ()

    def __call__(self, fn: Callable[[torch.Tensor], Any], *args: Any, **kwargs: Any) -> Any:
        model = self._ref()
        apply = type(model)._apply
        if keeps_devices(fn):
            with placeholders_stay_meta():
                return apply(model, fn, *args, **kwargs)
        name = _caller_name()
        offloaded = _offloaded_names(model)
        if offloaded:
            shown = ", ".join(repr(n) for n in offloaded[:3]) + (" ..." if len(offloaded) > 3 else "")
            # NotImplementedError, a RuntimeError: what the incumbent raises here (torch's copy out of meta, or
            # its own RuntimeError), so code catching either type catches this one
            raise NotImplementedError(
                f"Cannot call .{name}() on a {type(model).__name__} dispatched with offloaded modules ({shown}): "
                "their weights live in the weights map (CPU/disk) and would not follow a device move (casts to "
                "another dtype are fine). Dispatch it again with another device map, or call "
                "bigmodel.remove_hook_from_submodules(model) first, which brings the weights back into the modules."
            )
        devices = _execution_devices(model)
        if devices:  # none: other code removed the hooks (peft's re-dispatch through accelerate does): a plain move
            logger.warning(  # opens with the incumbent's words: code matches this warning by its text
                "%s Calling .%s() on a model dispatched with hooks moves its tensors, but its hooks keep moving "
                "inputs to their execution devices (%s); dispatch it again with the new device map instead.",
                INCUMBENT_MOVE_WARNING, name, ", ".join(devices),
            )
        return apply(model, fn, *args, **kwargs)


def _guard_moves(model: nn.Module, tied: list[list[str]]) -> None:
    """Refuse device moves of the model while parts are offloaded (casts go through); remember its ties.

    Every :class:`~torch.nn.Module` method that moves or casts tensors (``to``, ``cpu``,
    ``half``, ``float``, ``type``, the per-backend ones, ``to_empty`` ...) goes through
    ``Module._apply``; guarding that one method on the instance covers all of them, including
    any torch adds, without naming them.
    """
    patch_attribute(model, TIED_PARAMS, tied)
    patch_attribute(model, "_apply", GuardedApply(model))


def _runs_on_accelerator(device: DeviceSpec | None) -> bool:
    """True when forwards run on an accelerator: CPU-held weights are then pinned once, and
    offloaded values reach the device through :class:`~bigmodel.transfer.copies.DeviceStager`
    (side-stream copies; disk values through its pinned staging buffer)."""
    return device is not None and device != "disk" and is_accelerator(device)


def _enable_prefetch(model: nn.Module, device: DeviceSpec) -> None:
    """Prefetch for ``model``'s offloading hooks, staging to the device when it is an accelerator.

    On the CPU, the file-backed weights the model holds in place (a device map's ``"cpu"`` part:
    views of the checkpoint's mapped files) are read into the page cache in the background, in
    module order (:func:`~bigmodel.offload.resident.read_resident`), so that the first forward
    finds them read sequentially rather than faulting them in one read at a time.  Embeddings are
    left out: a forward reads only the rows of its tokens (a weight tied to a head is read for it).
    """
    accelerator = _runs_on_accelerator(device)
    prefetcher = enable_prefetch(model, stage=DeviceStager() if accelerator else None)
    if prefetcher is not None and not accelerator:
        read_resident([*module.parameters(recurse=False), *module.buffers(recurse=False)]
                      for module in model.modules() if not isinstance(module, (nn.Embedding, nn.EmbeddingBag)))


def _is_dispatched(model: nn.Module) -> bool:
    """True if ``model`` carries hooks from an earlier dispatch/offload (its weights may be placeholders)."""
    return TIED_PARAMS in model.__dict__ or any(has_offloaded_params(m) for m in model.modules())


def _undispatch(model: nn.Module, what: str) -> None:
    """Remove the hooks of an earlier dispatch/offload, bringing the real weights back into ``model``."""
    if _is_dispatched(model):
        logger.info("%s: the model was already dispatched; removing its hooks (weights come back) first.", what)
        remove_hook_from_submodules(model)


@contextlib.contextmanager
def hooks_removed_on_error(model: nn.Module) -> Iterator[None]:
    """Attach hooks to an undispatched ``model`` inside the block; if it raises, remove those attached so far.

    A refused attach (a weights map lacking a module's tensor is found at that module) then leaves no
    module half offloaded: their weights come back from the hooks' weights map, as after the earlier
    dispatch's removal.  A model that held hooks of its own before (layerwise casting) is left as the
    attach left it, so that no hook of the caller's is removed.
    """
    had_hooks = any("_hf_hook" in module.__dict__ for module in model.modules())
    try:
        yield
    except BaseException:
        if not had_hooks:
            remove_hook_from_submodules(model)
        raise
