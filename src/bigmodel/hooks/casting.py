"""Layerwise casting: weights stored in a small dtype (fp8, bf16), cast up for each layer's forward."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import nn

from .registry import ModelHook, add_hook_to_module

# Layers whose weights are safe to store in a low-precision dtype and cast up per forward.
SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


def _cast_own_tensors(module: nn.Module, dtype: torch.dtype, non_blocking: bool) -> None:
    """Cast the module's own floating parameters to ``dtype`` (in place: the Parameter objects stay)."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point() and param.dtype != dtype and param.device.type != "meta":
            param.data = param.data.to(dtype, non_blocking=non_blocking)


class LayerwiseCastingHook(ModelHook):
    """Stores a layer's weights in ``storage_dtype`` and runs its forward in ``compute_dtype``.

    Args:
        storage_dtype: dtype the weights are kept in between forwards (e.g. ``torch.float8_e4m3fn``).
        compute_dtype: dtype of the forward (e.g. ``torch.bfloat16``); the weights are cast to it
            before the forward and back to ``storage_dtype`` after.
        non_blocking: asynchronous casts on accelerators.
    """

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking

    def init_hook(self, module: nn.Module) -> nn.Module:
        _cast_own_tensors(module, self.storage_dtype, self.non_blocking)
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        _cast_own_tensors(module, self.compute_dtype, self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output):  # noqa: ANN001, ANN201
        _cast_own_tensors(module, self.storage_dtype, self.non_blocking)
        return output

    def forward_failed(self, module: nn.Module) -> None:
        """Back to the storage dtype when the forward raised (else the upcast copies would stay)."""
        _cast_own_tensors(module, self.storage_dtype, self.non_blocking)

    def detach_hook(self, module: nn.Module) -> nn.Module:
        _cast_own_tensors(module, self.compute_dtype, self.non_blocking)
        return module


def attach_layerwise_casting_hooks(
    module: nn.Module,
    storage_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    skip_modules_pattern: str | Sequence[str] | None = None,
    skip_modules_classes: Sequence[type[nn.Module]] | None = None,
    non_blocking: bool = False,
) -> None:
    """Attach a :class:`LayerwiseCastingHook` to every supported layer of ``module``.

    A layer is supported when it is an instance of one of
    ``SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING``.  A module whose name matches a pattern
    (``re.search``) or whose class is in ``skip_modules_classes`` is skipped with its whole subtree.

    Args:
        module: the model.
        storage_dtype: dtype the weights are stored in.
        compute_dtype: dtype of the forwards.
        skip_modules_pattern: regex (or list of regexes) of module names to leave alone.
        skip_modules_classes: module classes to leave alone.
        non_blocking: asynchronous casts.
    """
    patterns = [skip_modules_pattern] if isinstance(skip_modules_pattern, str) else list(skip_modules_pattern or [])
    compiled = [re.compile(p) for p in patterns]
    skip_classes = tuple(skip_modules_classes or ())
    _attach(module, "", storage_dtype, compute_dtype, compiled, skip_classes, non_blocking)


def _attach(module: nn.Module, name: str, storage_dtype: torch.dtype, compute_dtype: torch.dtype,
            patterns: list[re.Pattern], skip_classes: tuple, non_blocking: bool) -> None:
    if (skip_classes and isinstance(module, skip_classes)) or any(p.search(name) for p in patterns):
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        add_hook_to_module(module, LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking), append=True)
        return
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        _attach(child, full, storage_dtype, compute_dtype, patterns, skip_classes, non_blocking)
