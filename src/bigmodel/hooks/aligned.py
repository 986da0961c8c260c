"""``align_module_device``: a module's offloaded tensors as real tensors for the duration of a ``with`` block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from .align_hook import AlignDevicesHook, offload_hook_of
from .moving import own_parameters_moved

__all__ = ["align_module_device"]


@contextlib.contextmanager
def align_module_device(module: nn.Module, execution_device: Any = None) -> Iterator[None]:
    """Context manager: inside it, ``module``'s offloaded tensors are real tensors on ``execution_device``.

    Changes made to them inside the context are kept: on exit, a value that differs from the
    weights map's is stored back into the weights map (replacing the entry; the read-only
    on-disk files are never written to).  A module without an offloading hook has its own
    (direct) parameters moved to ``execution_device`` (if given) for the duration, in place: the
    Parameter objects, and ties between them, are kept; submodules are left alone.

    Args:
        module: the module.
        execution_device: device for the tensors (default: the hook's execution device).

    Raises:
        ValueError: ``execution_device`` is not a device spec.
        KeyError: the weights map lacks one of the module's offloaded tensors (names it).
    """
    hook = offload_hook_of(module)
    if hook is None:
        with own_parameters_moved(module, execution_device):
            yield
        return
    original = hook.execution_device
    if execution_device is not None:
        hook.execution_device = execution_device
    try:
        values = {name: hook.weights_map[name] for name in hook.offloaded_names}  # type: ignore[index]
        # Own copies: writes inside the context never reach a (read-only) mmap'd file.
        hook.load_weights(module, {name: v.clone() for name, v in values.items()})
        yield
        _store_changes(module, hook, values)
    finally:
        hook.unload_weights(module)
        hook.execution_device = original
        if hook.prefetcher is not None:
            hook.prefetcher.invalidate()


def _store_changes(module: nn.Module, hook: AlignDevicesHook, values: Mapping[str, torch.Tensor]) -> None:
    from ..core.tensors import get_submodule_and_name

    for name, old in values.items():
        sub, attr = get_submodule_and_name(module, name)
        current = sub._parameters[attr] if attr in sub._parameters else sub._buffers[attr]
        if current.is_meta:  # aligned to meta: nothing to store
            continue
        new = current.detach().to(old.device, old.dtype)
        if not torch.equal(new, old):
            _store(hook.weights_map, name, new)


def _store(weights_map: Any, name: str, value: torch.Tensor) -> None:
    """Replace the entry ``name`` of a (possibly prefixed, possibly read-only) weights map."""
    dataset, prefix = weights_map, ""
    while hasattr(dataset, "dataset") and hasattr(dataset, "prefix"):
        prefix += dataset.prefix
        dataset = dataset.dataset
    key = prefix + name
    if hasattr(dataset, "__setitem__"):
        dataset[key] = value
    elif isinstance(getattr(dataset, "state_dict", None), dict):
        dataset.state_dict[key] = value  # OffloadedWeightsLoader: an in-memory entry shadows the disk one
    else:
        raise TypeError(
            f"Cannot store the changed value of {key!r}: the weights map {type(dataset).__name__} is read-only "
            "and has no in-memory `state_dict`; use a dict or an OffloadedWeightsLoader as weights map."
        )
