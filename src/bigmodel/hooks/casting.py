"""Layerwise casting: weights stored in a small dtype (fp8, bf16), cast up for each layer's forward."""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Sequence

import torch
from torch import nn

from ..core.tensors import find_tied_parameters
from .placeholders import offload_source, placeholders_stay_meta
from .registry import TIED_PARAMS, ModelHook, add_hook_to_module

logger = logging.getLogger(__name__)

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


def _cast_own_tensors(module: nn.Module, dtype: torch.dtype, non_blocking: bool, keep: Collection[str] = ()) -> None:
    """Cast the module's own floating parameters held in memory to ``dtype`` (in place: the Parameter
    objects stay); offloaded ones (``meta`` placeholders) and those named in ``keep`` are left alone."""
    for name, param in module._parameters.items():
        if param is None or name in keep or param.device.type == "meta":
            continue
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype, non_blocking=non_blocking)


def _cast_placeholders(module: nn.Module, dtype: torch.dtype, keep: Collection[str]) -> None:
    """Cast the module's offloaded floating parameters (``meta`` placeholders) to ``dtype``: the
    offloading hook reads the placeholder's dtype and casts the stored value to it at each load."""
    with placeholders_stay_meta(), torch._C.DisableTorchFunctionSubclass():  # nothing is read: stays on meta
        for name, param in module._parameters.items():
            if param is None or name in keep or not param.is_meta:
                continue
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)


def _round_offloaded_loads(module: nn.Module, dtype: torch.dtype, keep: Collection[str]) -> None:
    """Make every load of the module's offloaded floating parameters round the stored value to ``dtype``
    first, whatever dtype the placeholder has (after ``model.to(torch.bfloat16)`` the value is then
    the storage-dtype value in bfloat16, as a resident layer holds it, not the stored one rounded once)."""
    for name, param in module._parameters.items():
        source = offload_source(param) if param is not None and name not in keep else None
        slot = source[0].slot(source[1]) if source is not None else None
        if slot is not None:
            slot.round_to = dtype


class LayerwiseCastingHook(ModelHook):
    """Stores a layer's weights in ``storage_dtype`` and runs its forward in ``compute_dtype``.

    Composed with offloading, in either order of attaching: an offloaded weight is kept in
    ``storage_dtype`` too (its placeholder shows it, and each load rounds the stored value to
    it), so the layer computes with exactly the values it would hold in memory.  The hook runs
    next to the forward (``runs_innermost``), after the offloading hook has put the weights in.

    One rule, with or without offload, diffusers' (``apply_layerwise_casting``): the weights are
    kept in ``storage_dtype`` between forwards.  A model-wide cast (``model.to(torch.float64)``,
    ``.double()``) changes the dtype of the kept values until the layer's next forward, which
    computes in ``compute_dtype`` and stores them in ``storage_dtype`` again.  An offloaded
    weight's kept value is its stored value rounded to ``storage_dtype``.

    Args:
        storage_dtype: dtype the weights are kept in between forwards (e.g. ``torch.float8_e4m3fn``).
        compute_dtype: dtype of the forward (e.g. ``torch.bfloat16``); the weights are cast to it
            before the forward and back to ``storage_dtype`` after.
        non_blocking: asynchronous casts on accelerators.
        keep: names of the layer's own parameters left in their dtype between forwards (weights
            shared with a layer that is not cast, e.g. a head tied to an input embedding); they
            are still cast to ``compute_dtype`` for the forward.
    """

    runs_innermost = True

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype, non_blocking: bool,
                 keep: Collection[str] = ()) -> None:
        self.storage_dtype = storage_dtype
        self.compute_dtype = compute_dtype
        self.non_blocking = non_blocking
        self.keep = frozenset(keep)
        self._kept_dtypes: dict[str, torch.dtype] = {}

    def init_hook(self, module: nn.Module) -> nn.Module:
        _cast_placeholders(module, self.storage_dtype, self.keep)  # offloaded: each load rounds to it
        _round_offloaded_loads(module, self.storage_dtype, self.keep)
        _cast_own_tensors(module, self.storage_dtype, self.non_blocking, self.keep)
        return module

    def pre_forward(self, module: nn.Module, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self._kept_dtypes = {name: module._parameters[name].dtype for name in self.keep}
        _cast_own_tensors(module, self.compute_dtype, self.non_blocking)
        return args, kwargs

    def post_forward(self, module: nn.Module, output):  # noqa: ANN001, ANN201
        self._back_to_storage(module)
        return output

    def forward_failed(self, module: nn.Module) -> None:
        """Back to the storage dtype when the forward raised (else the upcast copies would stay)."""
        self._back_to_storage(module)

    def _back_to_storage(self, module: nn.Module) -> None:
        # Held weights, and the placeholders of weights the module's own offloading hook has just
        # put back (a model-wide ``.to(dtype)`` changed them until this forward, as on a plain model).
        _cast_own_tensors(module, self.storage_dtype, self.non_blocking, self.keep)
        _cast_placeholders(module, self.storage_dtype, self.keep)
        for name, dtype in self._kept_dtypes.items():
            _cast_own_tensors(module, dtype, self.non_blocking, self.keep.difference([name]))
        self._kept_dtypes = {}

    def detach_hook(self, module: nn.Module) -> nn.Module:
        _cast_own_tensors(module, self.compute_dtype, self.non_blocking, self.keep)
        _cast_placeholders(module, self.compute_dtype, self.keep)  # still offloaded: loaded in the compute dtype
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
    A weight shared with a module that is not cast (a head tied to an input embedding) keeps
    its dtype between forwards: storing it in ``storage_dtype`` would hand the other module
    rounded, low-precision values it cannot compute with.  Works before or after the model is
    dispatched or offloaded, with the same result.

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
    layers = dict(_layers(module, "", compiled, tuple(skip_modules_classes or ())))
    keep = _shared_with_layers_not_cast(module, layers)
    for name, layer in layers.items():
        hook = LayerwiseCastingHook(storage_dtype, compute_dtype, non_blocking, keep=keep.get(name, ()))
        add_hook_to_module(layer, hook, append=True)


def _layers(module: nn.Module, name: str, patterns: list[re.Pattern], skip_classes: tuple):
    """``(name, layer)`` of every supported layer not skipped (a skipped module skips its subtree)."""
    if (skip_classes and isinstance(module, skip_classes)) or any(p.search(name) for p in patterns):
        return
    if isinstance(module, SUPPORTED_PYTORCH_LAYERS_FOR_UPCASTING):
        yield name, module
        return
    for child_name, child in module.named_children():
        yield from _layers(child, f"{name}.{child_name}" if name else child_name, patterns, skip_classes)


def _shared_with_layers_not_cast(model: nn.Module, layers: dict[str, nn.Module]) -> dict[str, set[str]]:
    """Layer name → names of its own parameters tied to a parameter of a module that is not cast.

    Ties are found by identity, and also read from what a dispatch recorded (an offloaded member
    of a tied group has a placeholder of its own, so the tie is not visible by identity).
    """
    groups = [*find_tied_parameters(model), *(model.__dict__.get(TIED_PARAMS) or ())]
    keep: dict[str, set[str]] = {}
    for group in groups:
        owners = {name: name.rpartition(".")[0] for name in group}
        if all(owner in layers for owner in owners.values()):
            continue
        for name, owner in owners.items():
            if owner in layers:
                keep.setdefault(owner, set()).add(name.rpartition(".")[2])
                logger.info("Layerwise casting keeps %s in its dtype: it is shared with %s, which is not cast.",
                            name, ", ".join(n for n, o in owners.items() if o not in layers))
    return keep
