"""Device specs and accelerator lookup: the only module that knows about backends.

A device spec is what users put in a device map or a budget: an ``int`` (accelerator
index), ``"cpu"``, ``"disk"``, ``"meta"``, a :class:`torch.device`, or a string such as
``"cuda:1"``.  Accelerators are found through :mod:`torch.accelerator`, so CUDA, XPU,
MPS, NPU ... all work without a per-backend branch.
"""

from __future__ import annotations

import gc
import numbers
import re
from typing import Any, Union

import torch

DeviceSpec = Union[int, str, torch.device]

_DEVICE_STRING = re.compile(r"^(?P<type>[a-z_]+[a-z0-9_]*)(?::(?P<index>\d+))?$")


class DeviceSpecError(ValueError, RuntimeError):
    """A device spec that names no device, or an accelerator where torch sees none.

    A ValueError, and also a RuntimeError (what torch raises for an unknown device string, and so
    what code written for the incumbent catches), so either ``except`` clause catches it.
    """


def accelerator_type() -> str | None:
    """The current accelerator's device type (``"cuda"``, ``"xpu"``, ``"mps"`` ...), or None."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


def accelerator_count() -> int:
    """Number of accelerator devices visible to torch (0 on a CPU-only machine)."""
    return torch.accelerator.device_count() if torch.accelerator.is_available() else 0


def normalize_device(device: DeviceSpec) -> int | str:
    """Map a device spec onto the canonical key used in device maps and budgets.

    Accelerator devices become their integer index, ``"cpu"``/``"disk"``/``"meta"``
    stay strings.  ``"cuda:1"`` and ``torch.device("cuda", 1)`` become ``1``.

    Raises:
        DeviceSpecError (a ValueError and RuntimeError): if the spec is not a device (names the value
            and the accepted forms).
    """
    if isinstance(device, bool):
        raise DeviceSpecError(f"Device {device!r} is not a device spec; use an int, 'cpu', 'disk' or 'cuda:0'.")
    if isinstance(device, numbers.Integral):  # an int, or a numpy integer (torch.device takes those too)
        device = int(device)
    if isinstance(device, int):
        if device < 0:
            raise DeviceSpecError(f"Device index {device} is negative; accelerator indices start at 0.")
        return device
    if isinstance(device, torch.device):
        if device.type in ("cpu", "meta"):
            return device.type
        return device.index if device.index is not None else 0
    if isinstance(device, str):
        text = device.strip().lower()
        if text in ("cpu", "disk", "meta"):
            return text
        if text.isdigit():
            return int(text)
        match = _DEVICE_STRING.match(text) if _is_torch_device_string(text) else None
        if match:
            if match.group("type") in ("cpu", "disk", "meta"):
                return match.group("type")  # "cpu:0" is the cpu
            index = match.group("index")
            return int(index) if index is not None else 0
    raise DeviceSpecError(
        f"Device {device!r} is not a device spec; use an int accelerator index, 'cpu', "
        "'disk', 'meta', a torch.device or a string like 'cuda:1'."
    )


def _is_torch_device_string(text: str) -> bool:
    """True if torch knows the device type of ``text`` (rejects made-up names such as ``"gpu"``)."""
    try:
        torch.device(text)
    except RuntimeError:
        return False
    return True


def _accelerator_function(name: str, backend_name: str) -> Any:
    """``torch.accelerator.<name>``, or on torch releases that lack it (2.7-2.9) the current
    backend module's ``<backend_name>`` (``torch.<type>.<backend_name>``); None if neither exists."""
    function = getattr(torch.accelerator, name, None)
    if function is None:
        kind = accelerator_type()
        function = getattr(getattr(torch, kind, None), backend_name, None) if kind else None
    return function


def accelerator_memory_info(index: int) -> tuple[int, int] | None:
    """``(free, total)`` bytes of accelerator ``index``, or None when the backend cannot report it."""
    query = _accelerator_function("get_memory_info", "mem_get_info")
    try:
        free, total = query(index)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return None
    return int(free), int(total)


def torch_device(device: DeviceSpec) -> torch.device:
    """The :class:`torch.device` for a spec; integers map onto the current accelerator type.

    Raises:
        DeviceSpecError (a ValueError and RuntimeError): for ``"disk"`` (not a torch device), a string
            torch does not know as a device (``"gpu"``), or an accelerator index on a machine without an
            accelerator.
    """
    if isinstance(device, torch.device):
        return device
    if isinstance(device, str) and not device.strip().isdigit():
        text = device.strip()
        if text == "disk":
            raise DeviceSpecError("'disk' is not a torch device; tensors mapped to disk live in the offload folder.")
        try:
            return torch.device(text)
        except RuntimeError as err:
            lower = text.lower()
            known = lower == "disk" or _is_torch_device_string(lower)
            case = f" (device names are lowercase: {lower!r})" if known else ""
            raise DeviceSpecError(
                f"Device {device!r} is not a device spec{case}; use an int accelerator index, 'cpu', 'disk', 'meta', "
                "a torch.device or a string like 'cuda:1'."
            ) from err
    index = normalize_device(device)
    kind = accelerator_type()
    if kind is None:
        raise DeviceSpecError(
            f"Device {device!r} names an accelerator but torch sees none; map it to 'cpu' or 'disk' instead."
        )
    return torch.device(kind, index)


def is_accelerator(device: DeviceSpec) -> bool:
    """True if the spec names an accelerator (not cpu, disk or meta)."""
    if isinstance(device, torch.device):
        return device.type not in ("cpu", "meta")
    return normalize_device(device) not in ("cpu", "disk", "meta")


def check_execution_device(device: DeviceSpec, argument: str = "execution_device") -> None:
    """Raise unless ``device`` is the CPU, ``meta`` or an accelerator this machine has.

    Raises:
        ValueError: not a device spec, ``"disk"``, or an accelerator type or index torch does not see
            (names the argument, the device, what the machine has and the fix), so that offloading
            fails when it is set up rather than at the first forward.
    """
    try:
        target = torch_device(device)
    except DeviceSpecError as err:
        raise DeviceSpecError(f"{argument}={device!r}: {err}") from err
    have = lacking_device(target)
    if have is not None:
        raise DeviceSpecError(
            f"{argument}={device!r} is not a device of this machine, which has {have}; pass an existing device "
            "or 'cpu'."
        )


def lacking_device(target: torch.device) -> str | None:
    """None if ``target`` is cpu, meta or an accelerator this machine has; else what it has instead
    (``"2 cuda device(s), 0 to 1"``, ``"no accelerator"``), for an error message."""
    if target.type in ("cpu", "meta"):
        return None
    kind, count = accelerator_type(), accelerator_count()
    if kind is None or target.type != kind or (target.index or 0) >= count:
        return f"{count} {kind} device(s), 0 to {count - 1}" if kind is not None and count else "no accelerator"
    return None


def device_sort_key(device: int | str) -> tuple[int, int]:
    """Order accelerators by index, then cpu, then disk (the order a device map fills)."""
    if isinstance(device, int):
        return (0, device)
    return ({"cpu": 1, "disk": 2}.get(device, 3), 0)


def empty_cache(device: torch.device) -> None:
    """Release cached allocator blocks of an accelerator (no-op on cpu/meta)."""
    if device.type in ("cpu", "meta") or not torch.accelerator.is_available():
        return
    release = _accelerator_function("empty_cache", "empty_cache")
    if release is not None:
        release()


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Release the cached allocator blocks of the current accelerator (nothing to do without one).

    Args:
        garbage_collection: run :func:`gc.collect` first, so tensors held only by reference
            cycles are freed before the cache is emptied (slow: use it sparingly).
    """
    if garbage_collection:
        gc.collect()
    empty_cache(torch.device(accelerator_type() or "cpu"))
