"""Give a dispatched model's offloading hooks one shared :class:`~bigmodel.dispatch.prefetch.Prefetcher`."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

from torch import nn

from .prefetch import DEFAULT_DEPTH, DEPTH_ENV, MAX_DEPTH, MIN_BYTES, Prefetcher, StageFn, stage as default_stage

logger = logging.getLogger(__name__)


def _configured_depth(depth: int | None) -> int:
    if depth is None:
        text = os.environ.get(DEPTH_ENV, "").strip()
        try:
            depth = int(text) if text else DEFAULT_DEPTH
        except ValueError:
            logger.warning("%s=%r is not an integer; using %d.", DEPTH_ENV, text, DEFAULT_DEPTH)
            depth = DEFAULT_DEPTH
    if depth > MAX_DEPTH:
        logger.warning("Prefetch depth %d capped at %d modules ahead (memory bound).", depth, MAX_DEPTH)
    return max(0, min(depth, MAX_DEPTH))


def enable_prefetch(
    model: nn.Module, depth: int | None = None, stage: StageFn | None = None, min_bytes: int = MIN_BYTES
) -> Prefetcher | None:
    """Give all offloading hooks of ``model`` one shared :class:`Prefetcher`.

    Args:
        model: a model with offloading AlignDevicesHooks attached.
        depth: modules staged ahead (default: ``$BIGMODEL_PREFETCH_DEPTH`` or 1; 0 disables; at most 2).
        stage: staging function (default :func:`bigmodel.dispatch.prefetch.stage`); :mod:`bigmodel.transfer.copies` supplies the
            pinned-memory, side-stream one for accelerators.
        min_bytes: modules with fewer offloaded bytes are not prefetched.

    Returns:
        The prefetcher, or None when disabled or nothing is offloaded.
    """
    from ..hooks.align_hook import loading_hook_of

    depth = _configured_depth(depth)
    hooks = [hook for module in model.modules() if (hook := loading_hook_of(module)) is not None]
    root = _root_hook(model)
    for hook in [*hooks, root] if root is not None else hooks:
        hook.prefetcher = None
    if depth == 0 or len(hooks) < 2:
        return None
    # The first forward follows the order of the modules in the model; a block's members run inside its hook.
    members = {id(member) for hook in hooks for _, member in getattr(hook, "members", ())}
    guess = [hook for hook in hooks if id(hook) not in members]
    prefetcher = Prefetcher(depth, stage if stage is not None else default_stage, min_bytes, guess)
    for hook in [*hooks, root] if root is not None else hooks:
        hook.prefetcher = prefetcher  # the root hook (no weights of its own) tells when a forward starts
    if callable(getattr(prefetcher.stage, "close", None)):  # its buffers go back with the model
        weakref.finalize(model, _close_stage, weakref.ref(prefetcher.stage)).atexit = False
    return prefetcher


def _root_hook(model: nn.Module) -> Any:
    """The model's own AlignDevicesHook when it puts no weights in (dispatch_model's main-device hook), else None."""
    from ..hooks.align_hook import AlignDevicesHook
    from ..hooks.registry import iter_hooks

    for hook in iter_hooks(model.__dict__.get("_hf_hook")):
        if isinstance(hook, AlignDevicesHook) and not hook.swaps_weights:
            return hook
    return None


def _close_stage(ref: weakref.ref) -> None:
    if (stage := ref()) is not None:
        stage.close()
