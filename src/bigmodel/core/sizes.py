"""Pure byte arithmetic: size strings, dtype sizes and module sizes.

Nothing here allocates tensor memory: every function reads only shapes and dtypes, so
it works on a model built on the ``meta`` device.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import re
from collections import defaultdict
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from .subclasses import is_tensor_subclass, stored_nbytes

logger = logging.getLogger(__name__)

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# The number is anything Python's float() reads that a unit can follow: a sign, "_" between digits,
# an exponent ("1e3MB", "+5GB", "1_000MB"), as accelerate reads it; inf/nan have no digits, so never match.
_SIZE_STRING = re.compile(
    r"^\s*(?P<number>[+-]?(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:e[+-]?\d[\d_]*)?)\s*(?P<unit>[a-z]*)\s*$",
    re.IGNORECASE,
)
# Decimal units written with a lowercase "b" ("10gb", "500Mb"): accelerate reads them as bits (an
# eighth of the bytes); bigmodel reads bytes and says so once per spelling.
_BIT_LOOKING_UNITS = ("kb", "mb", "gb")
_WARNED_BIT_UNITS: set[str] = set()

# Names accepted for a dtype given as a string (planning and the CLI use them).
_DTYPE_ALIASES = {
    "fp32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
    "fp64": torch.float64,
    "double": torch.float64,
}
# Sub-byte dtypes: torch stores them packed; a size estimate counts bits / 8 per element.
_SUB_BYTE = re.compile(r"^(?:u?int|float)(?P<bits>[1-7])$")
_STRING_ONLY_BITS = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2, "fp4": 4, "float4": 4, "int1": 1}


class CustomDtype(enum.Enum):
    """Storage formats torch has no dtype for, accepted wherever a dtype sizes a plan.

    Quantizers (diffusers, transformers) pass these to ``infer_auto_device_map(dtype=...)``
    and ``compute_module_sizes``: ``INT4`` counts half a byte per element, ``INT2`` a quarter,
    ``FP8`` one byte.  Any enum member whose value is such a name (the incumbent's
    ``CustomDtype`` included) is read the same way.
    """

    FP8 = "fp8"
    INT4 = "int4"
    INT2 = "int2"


def convert_file_size_to_int(size: int | str) -> int:
    """Convert a memory size to bytes.

    Args:
        size: an int (bytes) or a string such as ``"10GiB"``, ``"500MB"``, ``"1.5GB"``,
            ``"2KB"``.  KB/MB/GB/TB are powers of 10, KiB/MiB/GiB/TiB powers of 2; units are
            case-insensitive.  The number is read as Python's ``float`` reads it (``"1e3MB"``,
            ``"+5GB"``, ``"1_000MB"``, as accelerate does).  A bare number string is bytes.  accelerate reads ``"10gb"`` or
            ``"500Mb"`` (a lowercase final ``b``) as bits, an eighth of these bytes: such a
            spelling is logged once as a warning.

    Returns:
        The size in bytes.

    Raises:
        ValueError: if the string does not parse or the size is negative (names the value).
    """
    if isinstance(size, bool):
        raise ValueError(f"Size {size!r} is not a memory size; use bytes (int) or a string like '10GiB'.")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"Size {size} is negative; a memory size is a number of bytes >= 0.")
        return size
    if isinstance(size, float) and 0 <= size < math.inf:  # nan and inf fall through to the error
        return int(size)
    if isinstance(size, str):
        match = _SIZE_STRING.match(size)
        number = _float_or_none(match.group("number")) if match else None
        unit = match.group("unit").lower() if match else None
        if number is not None and unit in _SIZE_UNITS and 0 <= number * _SIZE_UNITS[unit] < math.inf:
            nbytes = int(number * _SIZE_UNITS[unit])
            _warn_if_bits_in_accelerate(size, match.group("number"), match.group("unit"), nbytes)
            return nbytes
    raise ValueError(
        f"Size {size!r} is not a memory size; use bytes (int) or a string such as '10GiB', "
        "'500MB', '1.5GB' (KB/MB/GB are powers of 10, KiB/MiB/GiB powers of 2)."
    )


def _float_or_none(number: str) -> float | None:
    """``float(number)``, or None where float refuses it (misplaced underscores: ``"1__0"``, ``"1_"``)."""
    try:
        return float(number)
    except ValueError:
        return None


def _warn_if_bits_in_accelerate(size: str, number: str, unit: str, nbytes: int) -> None:
    """Warn once per spelling when accelerate would read ``size`` as bits (``"10gb"``: 1.25 GB there)."""
    if not unit.endswith("b") or unit.lower() not in _BIT_LOOKING_UNITS or size in _WARNED_BIT_UNITS:
        return
    _WARNED_BIT_UNITS.add(size)
    logger.warning(
        "Size %r is read as %d bytes; accelerate reads a unit ending in a lowercase 'b' as bits (%d bytes). "
        "Write %r to keep this meaning without the warning.",
        size, nbytes, nbytes // 8, f"{number}{unit[:-1].upper()}B",
    )


def to_dtype(dtype: torch.dtype | str) -> torch.dtype | str:
    """Resolve a dtype given as a torch dtype or a name (``"bfloat16"``, ``"torch.float16"``, ``"bf16"``).

    Names of sub-byte storage formats that torch has no dtype for (``"int4"``, ``"fp4"`` on
    older torch) come back as the lower-case string, which :func:`dtype_byte_size` sizes.

    An enum member (:class:`CustomDtype`) is read through its value.

    Raises:
        ValueError: for an unknown name (names it and lists examples).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, enum.Enum) and isinstance(dtype.value, str):
        dtype = dtype.value
    if isinstance(dtype, str):
        name = dtype.strip().lower().removeprefix("torch.")
        if name in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[name]
        candidate = getattr(torch, name, None)
        if isinstance(candidate, torch.dtype):
            return candidate
        if name in _STRING_ONLY_BITS:
            return name
    raise ValueError(
        f"Unknown dtype {dtype!r}; use a torch dtype or a name such as 'float32', 'bfloat16', "
        "'float16', 'float8_e4m3fn', 'int8' or 'int4'."
    )


def floating_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` resolved (see :func:`to_dtype`) and checked to be a floating torch dtype; None stays None.

    Raises:
        ValueError: ``dtype`` is unknown or not a floating torch dtype (names it).
    """
    if dtype is None:
        return None
    resolved = to_dtype(dtype)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating torch dtype; pass e.g. torch.float16 or 'bfloat16'.")
    return resolved


def dtype_byte_size(dtype: torch.dtype | str) -> float:
    """Bytes one element of ``dtype`` takes.

    Sub-byte dtypes (``int1``..``int7``, ``uint1``..``uint7``, the strings ``"int4"``,
    ``"int2"``, ``"fp4"``) return a fraction (bits / 8).  ``torch.bool`` returns 1: torch
    stores one bool per byte.  Packed dtypes such as ``float4_e2m1fn_x2`` return their
    itemsize (1 byte holds two values).

    Raises:
        ValueError: for an unknown dtype name.
    """
    resolved = to_dtype(dtype)
    if isinstance(resolved, str):
        return _STRING_ONLY_BITS[resolved] / 8
    if resolved is torch.bool:
        return 1
    match = _SUB_BYTE.match(str(resolved).removeprefix("torch."))
    if match:
        return int(match.group("bits")) / 8
    return resolved.itemsize


@functools.lru_cache(maxsize=None)
def _element_bytes(dtype: torch.dtype | str) -> float:
    # dtype_byte_size parses the dtype's name; sizing a model asks once per tensor, so cache it.
    return dtype_byte_size(dtype)


def tensor_nbytes(tensor: torch.Tensor, dtype: torch.dtype | str | None = None) -> int:
    """Bytes of ``tensor`` if stored in ``dtype`` (its own dtype when None); exact for meta tensors.

    A wrapper tensor subclass (torchao's quantized weights) with no ``dtype`` given counts the
    bytes of its inner tensors (``Int8Tensor``: int8 data + scales), not numel × its outer dtype.
    """
    if dtype is None and is_tensor_subclass(tensor):
        return stored_nbytes(tensor)
    size = _element_bytes(tensor.dtype if dtype is None else dtype)
    return int(tensor.numel() * size + 0.9999) if size < 1 else tensor.numel() * int(size)


def planned_size(
    tensor: torch.Tensor, name: str, dtype: torch.dtype | str | None, special_dtypes: Mapping[str, object] | None
) -> int:
    if is_tensor_subclass(tensor):
        # Already stored in its own (quantized) form: a cast of the model never changes what it holds.
        return stored_nbytes(tensor)
    if special_dtypes and name in special_dtypes:
        return tensor_nbytes(tensor, special_dtypes[name])
    if dtype is None or not (tensor.is_floating_point() or tensor.is_complex()):
        # Integer and bool tensors keep their dtype when a model is cast.
        return tensor_nbytes(tensor)
    # Casting never makes a tensor larger than its current storage in the plan's arithmetic.
    return min(tensor_nbytes(tensor, dtype), tensor_nbytes(tensor))


def _unique_tensors(model: nn.Module, buffers_only: bool) -> Iterator[tuple[str, str, torch.Tensor]]:
    """``(module name, tensor name, tensor)`` for each tensor once, under its first name: parameters in
    ``named_parameters`` order, then buffers.

    One walk of the modules (``named_parameters`` and ``named_buffers`` would walk them twice).
    """
    seen: set[int] = set()
    buffers: list[tuple[str, str, torch.Tensor]] = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if not buffers_only:
            for name, param in module._parameters.items():
                if param is not None and id(param) not in seen:
                    seen.add(id(param))
                    yield module_name, prefix + name, param
        buffers.extend((module_name, prefix + name, buf) for name, buf in module._buffers.items() if buf is not None)
    for module_name, name, buf in buffers:
        if id(buf) not in seen:
            seen.add(id(buf))
            yield module_name, name, buf


def _enter_module(sizes: dict[str, int], modules: list[str], name: str) -> None:
    """Give ``name`` and its enclosing modules not in ``sizes`` yet a key, outermost first (``""`` too)."""
    chain = []
    while name not in sizes:
        chain.append(name)
        if not name:
            break
        name = name.rpartition(".")[0]
    for entered in reversed(chain):
        sizes[entered] = 0
        modules.append(entered)


def compute_module_sizes(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
    buffers_only: bool = False,
) -> dict[str, int]:
    """Bytes of every module and of every parameter/buffer, keyed by dotted name.

    ``""`` is the whole model.  A tensor shared by several modules (tied parameters) is
    counted once, under the first name :meth:`nn.Module.named_parameters` gives it.

    Args:
        model: the model (any device, meta included: only shapes and dtypes are read).
        dtype: if given, floating tensors are sized as if cast to it (never larger than
            they are now); integer and bool tensors keep their dtype.  A wrapper tensor
            subclass (torchao's quantized weights) always counts the bytes of its inner
            tensors (``__tensor_flatten__``), whatever ``dtype`` and ``special_dtypes`` say.
        special_dtypes: per-tensor dtype overrides, dotted name → dtype.
        buffers_only: count buffers only.

    Returns:
        dict name → bytes (ints) for ``""``, every module with tensors under it and every tensor;
        a ``defaultdict(int)``, as accelerate returns, so any other name (a module without
        tensors: an activation, a dropout) reads 0.  Keys come in accelerate's order: for each
        parameter (``named_parameters`` order), then each buffer, its enclosing modules from the
        outermost down, then the tensor (``"", "model", "model.embed", "model.embed.weight", ...``);
        a model without tensors gives an empty dict.
    """
    sizes: dict[str, int] = defaultdict(int)
    modules: list[str] = []  # the module keys, each after the modules enclosing it
    for owner, name, tensor in _unique_tensors(model, buffers_only):
        if owner not in sizes:
            _enter_module(sizes, modules, owner)
        size = planned_size(tensor, name, dtype, special_dtypes)
        sizes[name] = size
        sizes[owner] += size  # its own tensors here; those of the modules below it added next
    for name in reversed(modules):  # every module after those below it
        if name:
            sizes[name.rpartition(".")[0]] += sizes[name]
    return sizes


def compute_module_total_buffer_size(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    special_dtypes: Mapping[str, torch.dtype | str] | None = None,
) -> int:
    """Bytes of all buffers of ``model`` (persistent or not), sized as in :func:`compute_module_sizes`."""
    return compute_module_sizes(model, dtype=dtype, special_dtypes=special_dtypes, buffers_only=True).get("", 0)


def get_max_layer_size(
    modules: list[tuple[str, nn.Module]],
    module_sizes: Mapping[str, int],
    no_split_module_classes: list[str] | str | None,
) -> tuple[int, list[str]]:
    """The largest "layer" under ``modules`` and the names of all layers of that size.

    A layer is a module with no children, or whose class name is in
    ``no_split_module_classes`` (it is never split across devices, so it must fit whole).

    Args:
        modules: ``(name, module)`` pairs to search, e.g. ``list(model.named_children())``.
        module_sizes: bytes per name, from :func:`compute_module_sizes`.
        no_split_module_classes: class names never split; one name may be given as a plain
            string (``"LlamaDecoderLayer"``), as ``infer_auto_device_map`` accepts it.

    Returns:
        ``(max_size_in_bytes, [layer names with that size])``.
    """
    if isinstance(no_split_module_classes, str):
        no_split_module_classes = [no_split_module_classes]
    no_split = set(no_split_module_classes or ())
    max_size, names = 0, []
    stack = list(reversed(modules))
    while stack:
        name, module = stack.pop()
        children = list(module.named_children()) if isinstance(module, nn.Module) else []
        if not children or type(module).__name__ in no_split:
            size = module_sizes.get(name, 0)
            if size > max_size:
                max_size, names = size, [name]
            elif size == max_size:
                names.append(name)
        else:
            prefix = f"{name}." if name else ""
            stack.extend((f"{prefix}{child}", sub) for child, sub in reversed(children))
    return max_size, names


def calculate_maximum_sizes(model: nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """Total bytes of ``model`` and its largest layer, as ``(total, (layer_bytes, layer_names))``.

    No-split classes come from ``model._no_split_modules`` (the transformers convention) if set.
    """
    sizes = compute_module_sizes(model)
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    largest = get_max_layer_size(list(model.named_children()), sizes, no_split)
    return sizes[""], largest
