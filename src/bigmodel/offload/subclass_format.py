"""Wrapper tensor subclasses (torchao's quantized weights) in an offload folder: parts on disk, spec in the index.

A subclass tensor ``name`` (see :mod:`bigmodel.core.subclasses`) is stored as its plain inner
tensors, each a raw ``.dat`` file named ``<name>#<part>.dat`` (``<part>`` is the dotted path of the
inner tensor), and one ``index.json`` entry that says how to rebuild it::

    {"dtype": "float32", "shape": [128, 64],
     "subclass": {"class": "torchao.quantization:Int8Tensor", "stride": [64, 1],
                  "context": {"__dict__": {"block_size": [1, 64], "dtype": {"__dtype__": "float32"}, ...}},
                  "inner": {"qdata": null, "scale": null, "zero_point": null},
                  "parts": {"qdata": {"dtype": "int8", "shape": [128, 64]}, ...}}}

``dtype``/``shape`` are the outer ones.  The context (what ``__tensor_flatten__`` returns besides
the names) is JSON with tags for what JSON lacks: tuples, dicts, torch dtypes/devices/sizes,
enum members and dataclasses.  Nothing is pickled.  Reading a folder never imports anything: the
classes an entry names (the subclass, enums and dataclasses of its context) are looked up among
the modules already imported, and must be what the entry says they are (a tensor subclass with
``__tensor_unflatten__``, an ``Enum``, a dataclass).
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.subclasses import (
    SubclassSpec,
    flatten_tensor,
    is_tensor_subclass,
    unflatten_tensor,
)

SUBCLASS_KEY = "subclass"
PART_SEP = "#"

__all__ = [
    "PART_SEP",
    "SUBCLASS_KEY",
    "is_subclass_entry",
    "part_name",
    "spec_from_entry",
    "subclass_entry",
]


def part_name(name: str, path: str) -> str:
    """The offload-folder name of one part of subclass tensor ``name``: ``"<name>#<path>"``."""
    return f"{name}{PART_SEP}{path}"


def is_subclass_entry(entry: object) -> bool:
    """True for an ``index.json`` entry describing a wrapper tensor subclass."""
    return isinstance(entry, Mapping) and isinstance(entry.get(SUBCLASS_KEY), Mapping)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(path: object, where: str) -> type:
    """The class ``"module:Qualname"`` names, from a module already imported (never imports one)."""
    module_name, _, qualname = str(path).partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise ValueError(
            f"{where}: it names {path!r} but module {module_name!r} is not imported; import it (e.g. "
            f"`import {module_name.split('.')[0]}`) before loading (bigmodel never imports a module an offload "
            "folder names)."
        )
    obj: Any = module
    for attr in qualname.split("."):
        obj = getattr(obj, attr, None)
    if not isinstance(obj, type):
        raise ValueError(f"{where}: {path!r} is not a class of the installed {module_name}; offload the model again.")
    return obj


def encode_context(obj: Any, where: str) -> Any:
    """``obj`` (a ``__tensor_flatten__`` context) as JSON data; see the module docstring.

    Raises:
        TypeError: a value of a type that cannot be written without pickling (names ``where`` and the fix).
    """
    if obj is None or isinstance(obj, (bool, int, float, str)) and not isinstance(obj, enum.Enum):
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"__device__": str(obj)}
    if isinstance(obj, torch.Size):
        return {"__size__": list(obj)}
    if isinstance(obj, enum.Enum):
        return {"__enum__": _class_path(type(obj)), "name": obj.name}
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {"__tuple__": [encode_context(v, where) for v in obj]}
    if isinstance(obj, list):
        return [encode_context(v, where) for v in obj]
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return {"__dict__": {k: encode_context(v, f"{where}.{k}") for k, v in obj.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: encode_context(getattr(obj, f.name), f"{where}.{f.name}") for f in dataclasses.fields(obj)
                  if f.init}
        return {"__dataclass__": _class_path(type(obj)), "fields": fields}
    raise TypeError(
        f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which an offload folder cannot store without "
        "pickling (only None, bool, int, float, str, lists, tuples, dicts, torch dtypes/devices/sizes, enums and "
        "dataclasses of those); keep this module in memory (map it to 'cpu' or an accelerator, not 'disk')."
    )


def decode_context(data: Any, where: str) -> Any:
    """The context :func:`encode_context` wrote.

    Raises:
        ValueError: malformed data, or a class it names is not an enum/dataclass of an imported module.
    """
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_context(v, where) for v in data]
    if not isinstance(data, dict):
        raise ValueError(f"{where}: unexpected {type(data).__name__} in a stored context; offload the model again.")
    if "__dtype__" in data:
        dtype = getattr(torch, str(data["__dtype__"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: {data['__dtype__']!r} is not a torch dtype; offload the model again.")
        return dtype
    if "__device__" in data:
        return torch.device(str(data["__device__"]))
    if "__size__" in data:
        return torch.Size(int(v) for v in data["__size__"])
    if "__tuple__" in data:
        return tuple(decode_context(v, where) for v in data["__tuple__"])
    if "__dict__" in data and isinstance(data["__dict__"], dict):
        return {k: decode_context(v, f"{where}.{k}") for k, v in data["__dict__"].items()}
    if "__enum__" in data:
        cls = _resolve(data["__enum__"], where)
        if not issubclass(cls, enum.Enum) or str(data.get("name")) not in cls.__members__:
            raise ValueError(f"{where}: {data['__enum__']!r} has no member {data.get('name')!r}; offload again.")
        return cls[str(data["name"])]
    if "__dataclass__" in data and isinstance(data.get("fields"), dict):
        cls = _resolve(data["__dataclass__"], where)
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"{where}: {data['__dataclass__']!r} is not a dataclass; offload the model again.")
        return cls(**{k: decode_context(v, f"{where}.{k}") for k, v in data["fields"].items()})
    raise ValueError(f"{where}: unknown stored context {sorted(data)!r}; offload the model again.")


def _spec_json(spec: SubclassSpec, where: str) -> dict:
    return {
        "class": _class_path(spec.cls),
        "size": list(spec.size),
        "stride": list(spec.stride),
        "context": encode_context(spec.context, f"{where} (__tensor_flatten__ context)"),
        "inner": {k: (None if v is None else _spec_json(v, f"{where}.{k}")) for k, v in spec.inner.items()},
    }


def _spec_of(data: Mapping[str, Any], where: str) -> SubclassSpec:
    cls = _resolve(data.get("class"), where)
    if not issubclass(cls, torch.Tensor) or not callable(getattr(cls, "__tensor_unflatten__", None)):
        raise ValueError(f"{where}: {data.get('class')!r} is not a tensor subclass with __tensor_unflatten__.")
    inner = data.get("inner")
    if not isinstance(inner, Mapping):
        raise ValueError(f"{where}: the entry has no 'inner' names; offload the model again.")
    return SubclassSpec(
        cls, decode_context(data.get("context"), where), tuple(int(v) for v in data.get("size", ())),
        tuple(int(v) for v in data.get("stride", ())),
        {str(k): (None if v is None else _spec_of(v, f"{where}.{k}")) for k, v in inner.items()},
    )  # fmt: skip


def subclass_entry(name: str, tensor: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    """The ``index.json`` entry of subclass tensor ``name`` and its parts to write (by part name).

    Raises:
        TypeError: the tensor cannot be flattened, or its context cannot be stored without pickling
            (names the tensor and the fix).
    """
    parts, spec = flatten_tensor(tensor, name)
    meta = _spec_json(spec, name)
    meta["parts"] = {
        path: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for path, t in parts.items()
    }
    entry = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), SUBCLASS_KEY: meta}
    return entry, {part_name(name, path): t for path, t in parts.items()}


def spec_from_entry(entry: Mapping[str, Any], name: str) -> SubclassSpec:
    """The :class:`SubclassSpec` a subclass entry describes.

    Raises:
        ValueError: malformed, or naming a class that is not imported (names the entry and the fix).
    """
    return _spec_of(entry[SUBCLASS_KEY], f"offload entry {name!r}")


def part_files(folder: str | Path, name: str, entry: Mapping[str, Any]) -> dict[str, tuple[str, dict]]:
    """``path → (part name, part entry)`` of a subclass entry (the part's file is ``dat_path(folder, part name)``)."""
    parts = entry[SUBCLASS_KEY].get("parts")
    if not isinstance(parts, Mapping):
        raise ValueError(f"offload entry {name!r} lists no parts; offload the model again.")
    return {str(path): (part_name(name, str(path)), dict(info)) for path, info in parts.items()}


def rebuild(entry: Mapping[str, Any], name: str, parts: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The subclass tensor of ``entry`` around ``parts`` (path → tensor, as read from the part files)."""
    return unflatten_tensor(spec_from_entry(entry, name), parts)


def same_form(entry: Mapping[str, Any], name: str, tensor: torch.Tensor) -> str | None:
    """Why ``entry`` does not describe ``tensor``'s class, context and parts (None if it does); reads no file."""
    if not is_tensor_subclass(tensor):
        return "it holds a tensor subclass; the model holds a plain tensor"
    try:
        wanted, _ = subclass_entry(name, tensor)
    except TypeError as err:
        return str(err)
    stored = entry[SUBCLASS_KEY]
    for key in ("class", "context", "inner", "parts", "stride"):
        if stored.get(key) != wanted[SUBCLASS_KEY][key]:
            return f"its {key} differs from the model's"
    return None
