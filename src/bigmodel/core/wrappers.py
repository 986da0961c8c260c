"""Unwrapping a model from data-parallel and ``torch.compile`` wrappers."""

from __future__ import annotations

from torch import nn

# Wrappers that hold the real model as ``.module`` (DataParallel, DistributedDataParallel, DeepSpeed ...).
_MODULE_WRAPPERS = ("DataParallel", "DistributedDataParallel", "DeepSpeedEngine", "FullyShardedDataParallel")


def _is_compiled(model: nn.Module) -> bool:
    return type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod")


def extract_model_from_parallel(
    model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> nn.Module:
    """The plain module inside data-parallel and ``torch.compile`` wrappers.

    Args:
        model: a module, possibly wrapped (DDP/DataParallel's ``.module``, torch.compile's ``._orig_mod``).
        keep_fp32_wrapper: accepted for compatibility (mixed-precision forward wrappers are kept).
        keep_torch_compile: if the model was compiled, return the compiled wrapper around the
            unwrapped module (True), or the plain module (False).
        recursive: also unwrap wrapped submodules (replacing them in place by their inner module).

    Returns:
        The unwrapped module.
    """
    compiled = model if _is_compiled(model) else None
    if compiled is not None:
        model = model._orig_mod
    while type(model).__name__ in _MODULE_WRAPPERS and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    if recursive:
        _unwrap_children(model)
    if compiled is not None and keep_torch_compile:
        compiled._orig_mod = model
        return compiled
    return model


def _unwrap_children(module: nn.Module) -> None:
    for name, child in list(module.named_children()):
        inner = extract_model_from_parallel(child, keep_torch_compile=False)
        if inner is not child:
            setattr(module, name, inner)
        _unwrap_children(inner)
