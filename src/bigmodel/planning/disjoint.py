"""Device maps whose keys overlap (``{"": "disk", "0": "cpu"}``), rewritten without overlaps.

A device map may name a module and, inside it, a submodule or a tensor with another device:
each tensor then goes to the device of its longest matching key (``""`` matches everything,
see :func:`bigmodel.core.coverage.device_of`).  The hooks are attached per block of the map, so
dispatch first rewrites such a map into the same placement with no key inside another:
a key with keys inside it is replaced by its children and direct tensors.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from ..core.coverage import name_prefixes
from ..core.devices import DeviceSpec
from ..core.tensors import named_module_tensors

_STRING_MAPS = "'auto', 'balanced', 'balanced_low_0' or 'sequential'"


def check_map_type(device_map: object, allow_strings: bool) -> None:
    """Raise unless ``device_map`` is a dict-like map (or, with ``allow_strings``, a string).

    Raises:
        TypeError: names the argument, what was given and what is accepted.
    """
    if isinstance(device_map, Mapping) or (allow_strings and isinstance(device_map, str)):
        return
    accepted = "a dict module name → device" + (f", or one of {_STRING_MAPS}" if allow_strings else "")
    raise TypeError(
        f"device_map={device_map!r} (a {type(device_map).__name__}) is not a device map; pass {accepted}, "
        "e.g. {'': 'cpu'}."
    )


def disjoint_device_map(model: nn.Module, device_map: Mapping[str, DeviceSpec]) -> dict[str, DeviceSpec]:
    """The same placement as ``device_map`` (longest prefix wins), with no key inside another.

    Example: for ``nn.Sequential(nn.Linear, nn.ReLU, nn.Linear)``, ``{"": "disk", "0": "cpu"}``
    becomes ``{"0": "cpu", "1": "disk", "2": "disk"}`` and ``{"0": "cpu", "0.weight": "disk"}``
    becomes ``{"0.weight": "disk", "0.bias": "cpu"}``.

    Args:
        model: the model the map is for.
        device_map: module/tensor name → device; may have overlapping keys.

    Raises:
        TypeError: ``device_map`` is not a mapping.

    Returns:
        A new map.  A map without overlapping keys is returned as a copy, in its order; parts
        no key covers stay uncovered, and keys naming nothing in the model are kept.
    """
    check_map_type(device_map, allow_strings=False)
    parents = {prefix for key in device_map for prefix in list(name_prefixes(key))[1:]}
    if not parents & set(device_map):
        return dict(device_map)
    out: dict[str, DeviceSpec] = {}
    _visit(model, "", None, device_map, parents, out)
    for key, device in device_map.items():  # keys the walk did not reach (not in the model)
        if key not in parents and key not in out:
            out[key] = device
    return out


def _visit(
    module: nn.Module,
    name: str,
    inherited: DeviceSpec | None,
    device_map: Mapping[str, DeviceSpec],
    parents: set[str],
    out: dict[str, DeviceSpec],
) -> None:
    """Give ``module`` (named ``name``) its device, or split it when keys of the map lie inside it."""
    device = device_map.get(name, inherited)
    if name not in parents:
        if device is not None:
            out[name] = device
        return
    for child_name, child in module.named_children():
        _visit(child, f"{name}.{child_name}" if name else child_name, device, device_map, parents, out)
    for tensor_name, _ in named_module_tensors(module):
        full = f"{name}.{tensor_name}" if name else tensor_name
        tensor_device = device_map.get(full, device)
        if tensor_device is not None:
            out[full] = tensor_device


def module_blocks(
    model: nn.Module, device_map: Mapping[str, DeviceSpec], offloaded_kinds: tuple[str, ...]
) -> tuple[dict[str, DeviceSpec], list[str]]:
    """The blocks hooks are attached by: a module whose tensors a map names one by one is one block.

    Args:
        model: the model.
        device_map: a map without overlapping keys (:func:`disjoint_device_map`).
        offloaded_kinds: the devices whose tensors are offloaded (``("disk",)`` when the model
            runs on the CPU, ``("cpu", "disk")`` on an accelerator).

    Returns:
        ``(blocks, served)``: the map with the tensor keys of each module (not the root, and with no
        submodule mapped on its own) replaced by the module when one of them is offloaded, mapped
        to that offloaded device (the module's hook then offloads all its tensors); and the names
        of that module's tensors not offloaded themselves, which the hook serves from memory (they
        are never written to disk).  Other tensor keys are kept as given.
    """
    modules = dict(model.named_modules())
    owned: dict[str, list[str]] = {}
    blocks: dict[str, DeviceSpec] = {}
    for key, device in device_map.items():
        owner, _, attr = key.rpartition(".")
        direct = modules.get(owner)
        if key not in modules and direct is not None and any(attr == n for n, _ in named_module_tensors(direct)):
            owned.setdefault(owner, []).append(key)
        else:
            blocks[key] = device
    served: list[str] = []
    for owner, keys in owned.items():
        offloaded = [device_map[k] for k in keys if device_map[k] in offloaded_kinds]
        inside = [k for k in device_map if k.startswith(owner + ".") and k not in keys]
        if not owner or not offloaded or inside:  # the root, or submodules mapped on their own: left as given
            blocks.update((k, device_map[k]) for k in keys)
            continue
        blocks[owner] = offloaded[0]
        served.extend(k for k in keys if device_map[k] not in offloaded_kinds)
    return blocks, served
