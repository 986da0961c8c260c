"""Quantized weights in an offload folder and in RAM, and the weights map the offload hooks read them through.

Folder format: a quantized tensor ``name`` has one ``index.json`` entry::

    {"dtype": "float32", "shape": [1536, 576],
     "quantization": {"form": "int4", "group_size": 64,
                      "parts": {"data": {"dtype": "uint8", "shape": [1536, 288]},
                                "scale": {"dtype": "float16", "shape": [1536, 9]},
                                "zero": {"dtype": "uint8", "shape": [1536, 9]}}},
     "source": {"blake2b": "<digest of the full-precision bytes it was made from>"}}

``data`` is in ``<name>.dat``, the other parts in ``<name>@<part>.dat``.  ``dtype``/``shape`` are
those of the weight once dequantized, so a reader that does not know the format finds a file of
the wrong size and refuses it instead of misreading it.  An entry is reused only for the same
form and the same source digest (or, for a tensor with no value of its own on ``meta``, the
same form): a stale folder is quantized again, never reused.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..core.subclasses import flatten_tensor, is_tensor_subclass, unflatten_tensor
from .format import (
    QUANTIZED_PART_SEP,
    dat_path,
    dtype_name,
    load_offload_index,
    load_offloaded_weight,
    parse_dtype,
)
from .quantized import QuantizedWeight, quantize, source_digest
from .storage import OffloadWriter
from .subclass_format import part_name as subclass_part_name

logger = logging.getLogger(__name__)


def part_name(name: str, part: str) -> str:
    """The offload-folder name of one stored part: ``name`` for the data, ``name@scale`` ... for the others."""
    return name if part == "data" else f"{name}{QUANTIZED_PART_SEP}{part}"


def quantized_entry(weight: torch.Tensor, stored: QuantizedWeight, digest: str) -> dict:
    """The ``index.json`` entry describing ``stored`` (made from ``weight``, whose bytes have ``digest``)."""
    parts = {
        k: {"dtype": dtype_name(v.dtype), "shape": list(v.shape)}
        for k, v in stored.parts().items()
    }
    return {
        "dtype": dtype_name(weight.dtype),
        "shape": list(weight.shape),
        "quantization": {
            "form": stored.form,
            "group_size": stored.group_size,
            "parts": parts,
        },
        "source": {"blake2b": digest},
    }


def write_quantized(
    writer: OffloadWriter, name: str, weight: torch.Tensor, form: str
) -> None:
    """Quantize ``weight`` and stage its parts and entry in ``writer`` (committed with the rest)."""
    stored = quantize(weight, form)
    for part, tensor in stored.parts().items():
        writer.write(part_name(name, part), tensor)
        if part != "data":
            writer.index.pop(part_name(name, part))
    writer.index[name] = quantized_entry(weight, stored, source_digest(weight))


def is_quantized_entry(entry: Mapping[str, Any] | None) -> bool:
    return isinstance(entry, Mapping) and isinstance(entry.get("quantization"), Mapping)


def entry_reusable(
    folder: Path,
    name: str,
    entry: Mapping[str, Any] | None,
    form: str,
    weight: torch.Tensor,
) -> bool:
    """True if ``entry`` holds ``weight`` stored as ``form``, its files present with the right sizes.

    A tensor on ``meta`` (no bytes to compare) needs the same form and shape (the hook casts to
    its dtype); a real tensor also needs its dtype and the digest of its bytes to match.
    """
    if not is_quantized_entry(entry) or entry["quantization"].get("form") != form:
        return False
    if list(entry.get("shape", ())) != list(weight.shape):
        return False
    if weight.device.type != "meta" and entry.get("dtype") != dtype_name(weight.dtype):
        return False
    for part, info in entry["quantization"].get("parts", {}).items():
        path = dat_path(folder, part_name(name, part))
        need = parse_dtype(info["dtype"], f"offload entry {name!r}").itemsize * int(
            torch.Size(info["shape"]).numel()
        )
        if not path.is_file() or path.stat().st_size != need:
            return False
    return weight.device.type == "meta" or entry.get("source", {}).get(
        "blake2b"
    ) == source_digest(weight)


class QuantizedFolderWrites:
    """The weights a checkpoint load stores quantized in an offload folder (reusing matching entries).

    Args:
        writer: the load's writer for the offload folder (its index before the load is read once).
        names: the weights to store quantized (see :func:`bigmodel.offload.quantized.quantizable_names`).
        form: ``"int8"``, ``"int4"`` or ``"float8"``.
    """

    def __init__(self, writer: OffloadWriter, names: Iterable[str], form: str) -> None:
        self.writer, self.names, self.form = writer, set(names), form
        self.previous = load_offload_index(writer.folder)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def write(self, name: str, weight: torch.Tensor) -> None:
        """Stage ``weight`` stored as ``form``, unless the folder holds it so from the same bytes."""
        previous = self.previous.get(name)
        if entry_reusable(self.writer.folder, name, previous, self.form, weight):
            self.writer.index[name] = previous  # type: ignore[assignment]
        else:
            write_quantized(self.writer, name, weight, self.form)


def read_quantized(
    folder: str | os.PathLike, name: str, entry: Mapping[str, Any]
) -> QuantizedWeight:
    """The stored form of ``name`` as memory-mapped CPU tensors.

    Raises:
        ValueError / FileNotFoundError: a part file is missing or has the wrong size (offload again).
    """
    spec = entry["quantization"]
    parts = {
        part: load_offloaded_weight(dat_path(folder, part_name(name, part)), info)
        for part, info in spec["parts"].items()
    }
    return QuantizedWeight(
        form=spec["form"], data=parts["data"], scale=parts["scale"], zero=parts.get("zero"),
        shape=tuple(entry["shape"]), dtype=parse_dtype(entry["dtype"], f"offload entry {name!r}"),
        group_size=int(spec["group_size"]),
    )  # fmt: skip


def ensure_quantized(
    folder: str | os.PathLike, state: Mapping[str, torch.Tensor], form: str
) -> None:
    """Make ``folder`` hold every tensor of ``state`` stored as ``form``, reusing entries that match.

    Raises:
        ValueError: a tensor is on ``meta`` and the folder holds no matching entry (before anything is written).
    """
    folder = Path(folder)
    index = load_offload_index(folder) if folder.is_dir() else {}
    todo = [
        n
        for n, t in state.items()
        if not entry_reusable(folder, n, index.get(n), form, t)
    ]
    meta = [n for n in todo if state[n].device.type == "meta"]
    if meta:
        raise ValueError(
            f"{len(meta)} tensor(s) to store as {form} are on the meta device and {str(folder)!r}/index.json holds "
            f"no {form} entry for them: {meta[:3]}; load the checkpoint with the same offload_quantization."
        )
    if not todo:
        return
    logger.info(
        "Offload folder %s: quantizing %d tensor(s) to %s.", folder, len(todo), form
    )
    writer = OffloadWriter(folder)
    try:
        for name in todo:
            write_quantized(writer, name, state[name], form)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


class QuantizedWeightsMap(Mapping):
    """A weights map whose quantized entries the hooks read in their stored form.

    ``map[name]`` is always a full-precision CPU tensor (what every reader of a weights map
    expects); :meth:`packed` gives the stored form, which the offload hook moves to the
    execution device and dequantizes there.

    Args:
        base: the other weights (an ``OffloadedWeightsLoader`` or a dict).
        in_ram: quantized weights kept in memory.
        folder: an offload folder whose quantized ``index.json`` entries are read (memory maps).
        folder_names: the names read quantized from ``folder`` (others come from ``base``).
    """

    def __init__(
        self,
        base: Mapping[str, torch.Tensor],
        in_ram: Mapping[str, QuantizedWeight] | None = None,
        folder: str | os.PathLike | None = None,
        folder_names: Iterable[str] = (),
    ) -> None:
        self.base = base
        self.in_ram = dict(in_ram or {})
        self.folder = None if folder is None else Path(folder)
        index = load_offload_index(self.folder) if self.folder is not None else {}
        wanted = set(folder_names) - set(self.in_ram)
        self.on_disk = {
            n: e for n, e in index.items() if n in wanted and is_quantized_entry(e)
        }
        self._read: dict[str, QuantizedWeight] = {}
        self.overrides: dict[str, torch.Tensor] = {}

    def packed(self, key: str) -> QuantizedWeight | None:
        """The stored form of ``key``, or None when it is not stored quantized."""
        if key in self.overrides:
            return None
        if key in self.in_ram:
            return self.in_ram[key]
        if key not in self.on_disk:
            return None
        stored = self._read.get(key)
        if stored is None:
            stored = self._read[key] = read_quantized(
                self.folder, key, self.on_disk[key]
            )  # type: ignore[arg-type]
        return stored

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.overrides:
            return self.overrides[key]
        stored = self.packed(key)
        return stored.dequantize() if stored is not None else self.base[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        """Replace ``key`` by a full-precision value (``align_module_device`` stores changes this way)."""
        self.overrides[key] = value

    def __contains__(self, key: object) -> bool:
        return (
            key in self.overrides
            or key in self.in_ram
            or key in self.on_disk
            or key in self.base
        )

    def __iter__(self) -> Iterator[str]:
        seen = set()
        for key in (*self.in_ram, *self.on_disk, *self.base, *self.overrides):
            if key not in seen:
                seen.add(key)
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _stored_form(weights_map: Mapping[str, Any], name: str) -> QuantizedWeight | None:
    """The stored quantized form of ``name`` when the map (under any prefix views) has one."""
    dataset, key = weights_map, name
    while hasattr(dataset, "dataset") and hasattr(dataset, "prefix"):
        key = dataset.prefix + key
        dataset = dataset.dataset
    return dataset.packed(key) if isinstance(dataset, QuantizedWeightsMap) else None


def _may_hold_quantized(weights_map: Mapping[str, Any]) -> bool:
    """True if the map (under any prefix views) is a :class:`QuantizedWeightsMap`."""
    dataset = weights_map
    while hasattr(dataset, "dataset") and hasattr(dataset, "prefix"):
        dataset = dataset.dataset
    return isinstance(dataset, QuantizedWeightsMap)


def read_offloaded(
    weights_map: Mapping[str, Any], names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """The values of ``names`` as the hooks move them: a quantized weight as its stored parts.

    A weight stored quantized comes as ``<name>@data``, ``<name>@scale`` (and ``<name>@zero``)
    tensors, so that staging and copying code sees plain tensors; :func:`take_dequantized`
    rebuilds and dequantizes it once the parts are on the execution device.  A wrapper tensor
    subclass (torchao's quantized weights) comes as its inner tensors, ``<name>#<part>``;
    :func:`take_subclass` rebuilds the subclass from them on the execution device.
    """
    quantized = _may_hold_quantized(weights_map)  # asked once, not per name
    values: dict[str, torch.Tensor] = {}
    for name in names:
        stored = _stored_form(weights_map, name) if quantized else None
        if stored is None:
            value = weights_map[name]
            if is_tensor_subclass(value):  # moved as its plain parts, rebuilt by take_subclass
                parts, _ = flatten_tensor(value, name)
                values.update({subclass_part_name(name, path): tensor for path, tensor in parts.items()})
            else:
                values[name] = value
        else:
            values.update(
                {f"{name}@{part}": tensor for part, tensor in stored.parts().items()}
            )
    return values


def take_dequantized(
    weights_map: Mapping[str, Any],
    values: Mapping[str, torch.Tensor],
    name: str,
    device: Any,
) -> torch.Tensor | None:
    """Rebuild ``name`` from its parts in ``values``, move them to ``device`` and dequantize there (None: not quantized)."""
    if f"{name}@data" not in values:
        return None
    stored = _stored_form(weights_map, name)
    if stored is None:
        raise KeyError(
            f"{name!r} comes as quantized parts but its weights map has no stored form for it."
        )
    parts = {part: values[f"{name}@{part}"] for part in stored.parts()}
    moved = replace(
        stored, data=parts["data"], scale=parts["scale"], zero=parts.get("zero")
    )
    return moved.to(
        device, non_blocking=getattr(device, "type", "cpu") != "cpu"
    ).dequantize()


def take_subclass(
    weights_map: Mapping[str, Any], values: Mapping[str, torch.Tensor], name: str, device: Any
) -> torch.Tensor | None:
    """Rebuild the wrapper subclass ``name`` from its parts in ``values``, on ``device`` (None: not one).

    The parts move to ``device`` (no copy where they already are) and the subclass is built
    around them with ``__tensor_unflatten__``: the module computes with the stored (quantized)
    form itself, never a dequantized copy.  The class and context come from the weights map's value.
    """
    if name in values:
        return None
    value = weights_map[name]
    if not is_tensor_subclass(value):
        return None
    _, spec = flatten_tensor(value, name)
    non_blocking = getattr(device, "type", "cpu") != "cpu"
    parts = {}
    for path in spec.part_names():
        part = values[subclass_part_name(name, path)]
        parts[path] = part if device is None or part.device == device else part.to(device, non_blocking=non_blocking)
    return unflatten_tensor(spec, parts)
