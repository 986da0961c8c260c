"""Parsing of the options shared by the subcommands (budgets, dtypes, device maps)."""

from __future__ import annotations

import torch

from ..core.devices import normalize_device
from ..core.sizes import convert_file_size_to_int, to_dtype

DTYPE_CHOICES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn", "int4": "int4"}


def parse_max_memory(items: list[str] | None) -> dict[int | str, int] | None:
    """``["cpu=2GiB", "0=20GB", "disk=1TB"]`` → ``{"cpu": 2147483648, 0: 20000000000, "disk": ...}``.

    Raises:
        ValueError: an item is not ``DEVICE=SIZE``, names a bad device or size, or a device already
            budgeted (``cpu=1GB cpu=2GB``, ``0=1GB cuda:0=2GB``) (names the item).
    """
    if not items:
        return None
    budgets: dict[int | str, int] = {}
    for item in items:
        device, sep, size = item.partition("=")
        if not sep or not device or not size:
            raise ValueError(f"--max-memory item {item!r} is not DEVICE=SIZE; write e.g. cpu=2GiB, 0=20GB or disk=1TB.")
        try:
            key = normalize_device(device)
            nbytes = convert_file_size_to_int(size)
        except ValueError as error:
            raise ValueError(f"--max-memory item {item!r}: {error}") from error
        if key in budgets:
            raise ValueError(f"--max-memory item {item!r} budgets {key!r} a second time; give each device once.")
        budgets[key] = nbytes
    return budgets


def parse_dtype(name: str | None) -> torch.dtype | None:
    """A dtype to build and load a model in (``bf16``, ``float16``, ...); None stays None.

    Raises:
        ValueError: an unknown name, or a storage-only format such as int4 (names it and the accepted ones).
    """
    if name is None:
        return None
    resolved = to_dtype(DTYPE_CHOICES.get(name.lower(), name))
    if not isinstance(resolved, torch.dtype) or not (resolved.is_floating_point or resolved.is_complex):
        raise ValueError(
            f"--dtype {name!r} is not a floating dtype a model can run in; use float32, bfloat16 or float16 "
            "(fp32/bf16/fp16)."
        )
    return resolved


def parse_size_dtype(name: str) -> torch.dtype | str:
    """A dtype to size weights in, storage-only formats (``int4``) included.

    Raises:
        ValueError: an unknown name (names it and examples).
    """
    return to_dtype(DTYPE_CHOICES.get(name.lower(), name))


def dtype_label(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
