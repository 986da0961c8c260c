"""Tensor subclasses that wrap other tensors (torchao's quantized weights): their parts and their bytes.

A *wrapper subclass* (torch's "traceable wrapper subclass" protocol) is a ``torch.Tensor``
subclass whose values live in plain inner tensors: ``__tensor_flatten__()`` names them and
returns a context (the non-tensor settings), and ``cls.__tensor_unflatten__(inner, context,
size, stride)`` builds the same tensor again from them.  torchao's quantized weights
(``Int8Tensor``, ``Float8Tensor``, ``IntxUnpackedToInt8Tensor``...) are such tensors: an
``Int8Tensor`` of outer shape ``[out, in]`` and dtype float32 holds an int8 ``qdata`` and a
per-row ``scale``/``zero_point``; its ``numel() * element_size()`` (float32) is not what it
stores.

bigmodel treats such a tensor as the set of its plain parts: sizes are the parts' bytes, the
offload hooks move the parts and rebuild the subclass on the execution device (nothing is
dequantized), and the offload folder stores the parts (see :mod:`bigmodel.offload.subclass_format`).
Parts nested in parts (a subclass inside a subclass) are named by dotted paths (``"a.qdata"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "SubclassSpec",
    "check_flattenable",
    "detached",
    "flatten_tensor",
    "is_tensor_subclass",
    "stored_nbytes",
    "unflatten_tensor",
]


def is_tensor_subclass(tensor: object) -> bool:
    """True if ``tensor`` is a wrapper subclass that can be taken apart (``__tensor_flatten__``/``__tensor_unflatten__``).

    Plain tensors, ``nn.Parameter`` and its subclasses that keep their own storage
    (bitsandbytes-style ``Params4bit``, bigmodel's placeholders) are not.
    """
    cls = type(tensor)
    return (
        isinstance(tensor, torch.Tensor)
        and cls is not torch.Tensor
        and cls is not nn.Parameter
        and callable(getattr(tensor, "__tensor_flatten__", None))
        and callable(getattr(cls, "__tensor_unflatten__", None))
    )


def _overrides_dispatch(tensor: torch.Tensor) -> bool:
    """True if ``tensor``'s class intercepts every op (``__torch_dispatch__``): its values may not be in its storage."""
    own = getattr(type(tensor), "__torch_dispatch__", None)
    base = getattr(torch.Tensor, "__torch_dispatch__", None)
    return own is not None and getattr(own, "__func__", own) is not getattr(base, "__func__", base)


def check_flattenable(tensor: torch.Tensor, where: str, pinning: bool = False) -> None:
    """Refuse a tensor subclass whose values cannot be stored (or pinned and copied) as plain tensors.

    Args:
        tensor: any tensor.
        where: the tensor's name (``"model.layers.0.mlp.up_proj.weight"``), used in the error.
        pinning: the tensor is to be pinned in host memory and copied to an accelerator (the
            error then says how to keep it off that path), not written to an offload folder.

    Raises:
        TypeError: ``tensor``'s class intercepts ops (``__torch_dispatch__``) but does not implement
            ``__tensor_flatten__``/``__tensor_unflatten__``, or flattening it gives something other
            than tensors (names the tensor, its class and the fix).
    """
    if is_tensor_subclass(tensor):
        flatten_tensor(tensor, where, pinning)
        return
    # issubclass, not isinstance: nn.Parameter(subclass) keeps the subclass's type, with only a flag that
    # makes isinstance(..., nn.Parameter) true; real Parameter subclasses (bitsandbytes') keep their storage.
    if isinstance(tensor, torch.Tensor) and not issubclass(type(tensor), nn.Parameter) and _overrides_dispatch(tensor):
        why = "it does not implement __tensor_flatten__/__tensor_unflatten__"
        raise TypeError(_cannot_flatten(tensor, where, why, pinning))


def _cannot_flatten(tensor: torch.Tensor, where: str, why: str, pinning: bool = False) -> str:
    cls = type(tensor)
    if pinning:
        what = "pinned in host memory and copied to the accelerator"
        fix = ("keep its module on the accelerator (in a device map: map it to the main device, not 'cpu' or "
               "'disk'; or pass main_device='cpu')")
    else:
        what, fix = "stored", "keep its module in memory (map it to 'cpu' or an accelerator, not 'disk')"
    return (
        f"{where!r} is a {cls.__module__}.{cls.__qualname__} tensor subclass whose values cannot be {what} as plain "
        f"tensors ({why}); {fix}, or use a subclass implementing torch's __tensor_flatten__/__tensor_unflatten__ "
        "protocol (torchao's quantized tensors do)."
    )


@dataclass(frozen=True)
class SubclassSpec:
    """How to rebuild a wrapper subclass from its plain parts.

    Attributes:
        cls: the subclass.
        context: what ``__tensor_flatten__`` returned besides the names (passed back to ``__tensor_unflatten__``).
        size: the outer shape.
        stride: the outer strides (elements).
        inner: inner attribute name → the spec of a nested subclass, or None for a plain tensor (in order).
    """

    cls: type
    context: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]
    inner: dict[str, SubclassSpec | None] = field(default_factory=dict)

    def part_names(self, prefix: str = "") -> list[str]:
        """Dotted paths of the plain parts, in flatten order."""
        names: list[str] = []
        for attr, sub in self.inner.items():
            path = f"{prefix}{attr}"
            names.extend([path] if sub is None else sub.part_names(path + "."))
        return names


def flatten_tensor(
    tensor: torch.Tensor, where: str = "tensor", pinning: bool = False
) -> tuple[dict[str, torch.Tensor], SubclassSpec]:
    """Take a wrapper subclass apart: its plain parts (by dotted path) and the spec that rebuilds it.

    Nothing is copied: the parts are the subclass's own inner tensors.

    Args:
        tensor: a tensor for which :func:`is_tensor_subclass` holds.
        where: its name, for errors.
        pinning: the error's fix is for pinning, not storing (see :func:`check_flattenable`).

    Returns:
        ``(parts, spec)``; ``unflatten_tensor(spec, parts)`` is an equal tensor of the same class.

    Raises:
        TypeError: ``__tensor_flatten__`` fails or names something that is not a tensor (names ``where``).
    """
    try:
        names, context = tensor.__tensor_flatten__()
        inner = {str(name): getattr(tensor, name) for name in names}
    except Exception as err:  # a third-party protocol implementation: report any failure the same way
        raise TypeError(_cannot_flatten(tensor, where, f"__tensor_flatten__ failed: {err}", pinning)) from err
    parts: dict[str, torch.Tensor] = {}
    specs: dict[str, SubclassSpec | None] = {}
    for name, value in inner.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(_cannot_flatten(tensor, where, f"its inner {name!r} is a {type(value).__name__}", pinning))
        if is_tensor_subclass(value):
            sub_parts, specs[name] = flatten_tensor(value, f"{where}.{name}", pinning)
            parts.update({f"{name}.{k}": v for k, v in sub_parts.items()})
        else:
            specs[name] = None
            parts[name] = value.detach() if isinstance(value, nn.Parameter) else value
    spec = SubclassSpec(type(tensor), context, tuple(tensor.shape), tuple(tensor.stride()), specs)
    return parts, spec


def unflatten_tensor(spec: SubclassSpec, parts: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """Build the subclass ``spec`` describes around ``parts`` (plain tensors by dotted path; not copied).

    Raises:
        KeyError: a part named by ``spec`` is missing from ``parts`` (names it).
    """
    inner: dict[str, torch.Tensor] = {}
    for attr, sub in spec.inner.items():
        path = f"{prefix}{attr}"
        if sub is not None:
            inner[attr] = unflatten_tensor(sub, parts, path + ".")
        elif path in parts:
            inner[attr] = parts[path]
        else:
            raise KeyError(f"part {path!r} of a {spec.cls.__qualname__} is missing; offload the model again.")
    return spec.cls.__tensor_unflatten__(inner, spec.context, torch.Size(spec.size), tuple(spec.stride))


def stored_nbytes(tensor: torch.Tensor) -> int:
    """Bytes ``tensor`` really holds: for a wrapper subclass the sum of its plain parts, else numel × itemsize.

    Works on ``meta`` (only shapes and dtypes are read).  A subclass that cannot be flattened
    counts as its outer numel × itemsize.
    """
    if is_tensor_subclass(tensor):
        try:
            parts, _ = flatten_tensor(tensor)
        except TypeError:
            return tensor.numel() * tensor.element_size()
        return sum(part.numel() * part.element_size() for part in parts.values())
    return tensor.numel() * tensor.element_size()


def detached(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor object over ``tensor``'s data (``tensor.detach()``); a wrapper subclass is rebuilt
    around detached views of its parts, so it need not implement ``detach`` itself."""
    if is_tensor_subclass(tensor):
        parts, spec = flatten_tensor(tensor)
        return unflatten_tensor(spec, {path: part.detach() for path, part in parts.items()})
    return tensor.detach()
