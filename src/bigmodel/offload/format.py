"""The offload-folder format: ``index.json`` entries, ``.dat`` file names, and reading one tensor.

Format (shared with the ecosystem): ``index.json`` maps each tensor name to either

- ``{"dtype": "bfloat16", "shape": [4096, 4096]}`` with the tensor's bytes in ``<name>.dat``
  (raw, C order, no header; any dtype, bf16/fp8 included, round-trips bit-exactly), or
- ``{"safetensors_file": path, "weight_name": key, "dtype": "float16"}`` (bigmodel also
  writes ``"shape"``) pointing into an existing safetensors file, which is never rewritten, or
- a wrapper tensor subclass (torchao's quantized weights) stored as its plain parts, see
  :mod:`bigmodel.offload.subclass_format`.

A tensor name maps to its file through :func:`dat_path`: a ``/`` in the name (torch module
names may hold one) makes subfolders, and names that would leave the folder (``..``, absolute
paths, empty parts) are refused.  Reads are memory maps where the mapping is protected against
the file being rewritten (:mod:`bigmodel.core.file_maps`): a CPU tensor from the folder is then a
zero-copy view of its file; elsewhere it is read into memory.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoints.files import SafetensorsFile
from ..core.file_maps import map_file, read_bytes
from .subclass_format import (
    PART_SEP,
    SUBCLASS_KEY,
    is_subclass_entry,
    part_files,
    part_name,
    rebuild,
)

INDEX_NAME = "index.json"
# A quantized weight's parts besides its data: ``<name>@<part>.dat`` (see bigmodel.offload.quantized_store).
QUANTIZED_PART_SEP = "@"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling used in ``index.json``)."""
    return str(dtype).removeprefix("torch.")


class OffloadIndexError(ValueError, TypeError):
    """An offload index entry that cannot describe a tensor: its message names the entry, the index, the bad
    value and the fix.  Also a ``TypeError``: accelerate's reader fails on such entries with either type."""


_FIX = "the index is damaged or was edited by hand: correct that entry, or delete the offload folder and offload again."


def _shown(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a damaged entry can hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_dtype(name: object, where: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16`` (any torch dtype name, with or without ``torch.``).

    Raises:
        OffloadIndexError: not a torch dtype name (names ``where`` the name was found, and the fix).
    """
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise OffloadIndexError(
            f"{where}: dtype {_shown(name)} is not a torch dtype name (e.g. 'float32', 'bfloat16', 'int64', "
            f"'bool'); {_FIX}"
        )
    return dtype


def parse_shape(shape: object, where: str) -> tuple[int, ...]:
    """``[4096, 4096]`` → ``(4096, 4096)``; ``[]`` is a scalar's shape.

    Raises:
        OffloadIndexError: not a list of non-negative integers (a float, a string, a bool, a negative
            number, a missing shape), naming ``where`` and the value.
    """
    valid = isinstance(shape, (list, tuple)) and all(
        isinstance(d, numbers.Integral) and not isinstance(d, bool) and d >= 0 for d in shape
    )
    if not valid:
        raise OffloadIndexError(
            f"{where}: shape {_shown(shape)} is not a list of non-negative integers (e.g. [4096, 4096], [] for a "
            f"scalar); {_FIX}"
        )
    return tuple(int(d) for d in shape)


def check_offload_index(index: Mapping[str, object], where: str) -> None:
    """Check every entry of an offload index before any is read (no file is opened).

    Each entry must be a JSON object with a torch dtype name as ``dtype`` and a list of non-negative
    integers as ``shape``, and so must each part of a quantized or subclass entry; a pointer into a
    safetensors file may omit both (transformers writes no shape, accelerate's reader needs neither).

    Args:
        index: tensor name → entry, as :func:`load_offload_index` returns it.
        where: the index, for messages: its path (quoted), or how it was passed.

    Raises:
        OffloadIndexError: an entry is not an object, or its dtype or shape is missing or invalid (names
            ``where``, the key, the bad value and the fix).
    """
    for key, entry in index.items():
        label = f"Offload index {where}, entry {key!r}"
        if not isinstance(entry, Mapping):
            raise OffloadIndexError(f"{label} is {_shown(entry)}, not an object with \"dtype\" and \"shape\"; {_FIX}")
        _check_layout(entry, label, pointer="safetensors_file" in entry)
        for kind in ("quantization", SUBCLASS_KEY):
            spec = entry.get(kind)
            parts = spec.get("parts") if isinstance(spec, Mapping) else None
            for part, info in parts.items() if isinstance(parts, Mapping) else ():
                if not isinstance(info, Mapping):
                    raise OffloadIndexError(f"{label}, {kind} part {part!r} is {_shown(info)}, not an object; {_FIX}")
                _check_layout(info, f"{label}, {kind} part {part!r}", pointer=False)


def _check_layout(entry: Mapping[str, Any], label: str, *, pointer: bool) -> None:
    """Parse ``entry``'s dtype and shape (a safetensors ``pointer`` only those it has)."""
    if not pointer or "dtype" in entry:
        parse_dtype(entry.get("dtype"), label)
    if not pointer or "shape" in entry:
        parse_shape(entry.get("shape"), label)


def folder_path(folder: str | os.PathLike, argument: str = "offload_folder") -> Path:
    """``Path(folder)``, refusing an empty string: ``Path("")`` is the working directory, which an
    offload would fill with ``.dat`` files and an ``index.json``.

    Raises:
        ValueError: ``folder`` is empty or blank (names the argument and the fix).
    """
    if isinstance(folder, str) and not folder.strip():
        raise ValueError(
            f"{argument}={folder!r} is empty; pass the path of a folder for the offloaded weights (created if "
            "missing), e.g. 'offload' (or './' for the working directory)."
        )
    return Path(folder)


def dat_path(folder: str | os.PathLike, name: str, create: bool = False) -> Path:
    """The ``.dat`` file of tensor ``name`` in an offload folder: ``<folder>/<name>.dat``.

    Args:
        folder: the offload folder.
        name: the tensor name (a ``/`` in it makes a subfolder, as ``<name>.dat`` implies).
        create: create the subfolders, and check that none of them resolves outside ``folder``
            (a symbolic link planted in the folder).

    Returns:
        The file's path, always inside ``folder``.

    Raises:
        ValueError: the name is empty, absolute, or has an empty, ``.`` or ``..`` part (names the key).
    """
    parts = name.split("/") if isinstance(name, str) else [""]
    bad = not isinstance(name, str) or "\0" in name or (os.altsep is not None and os.altsep in name)
    if bad or any(part in ("", ".", "..") for part in parts):
        raise ValueError(
            f"Tensor name {name!r} cannot name a file inside the offload folder (it is empty, absolute, or has an "
            "empty, '.' or '..' part between '/'); rename the tensor or its module before offloading it."
        )
    root = Path(folder)
    path = root.joinpath(*parts[:-1], f"{parts[-1]}.dat")
    if create and len(parts) > 1:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.parent.resolve().is_relative_to(root.resolve()):
            raise ValueError(
                f"Tensor name {name!r}: {str(path.parent)!r} resolves outside the offload folder {str(root)!r} "
                "(a symbolic link); use an offload folder holding no links."
            )
    return path


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Read one offloaded tensor as a zero-copy, memory-mapped CPU tensor (read into memory where unprotected).

    Args:
        weight_file: the ``.dat`` file (ignored for entries pointing into a safetensors file).
        weight_info: its ``index.json`` entry (``{"dtype", "shape"}`` or ``{"safetensors_file", ...}``).

    Returns:
        The tensor on CPU (writable; writes are private to this process and never reach the file).

    Raises:
        OffloadIndexError: the entry's dtype or shape is missing or invalid (a ``ValueError``; names the file).
        ValueError: the file size does not match dtype × shape.
        FileNotFoundError: the file is missing.
    """
    if "safetensors_file" in weight_info:
        return _read_safetensors_entry(weight_info, Path(weight_file).stem, {})
    if isinstance(weight_info.get("subclass"), Mapping):
        return _read_subclass(Path(weight_file), weight_info)
    path = Path(weight_file)
    dtype, shape, nbytes = _layout(path, weight_info)
    if not path.is_file():
        raise FileNotFoundError(f"Offloaded weight file {str(path)!r} is missing; offload the model again.")
    size = path.stat().st_size
    if size != nbytes:
        raise ValueError(
            f"Offloaded weight file {str(path)!r} holds {size} bytes but its index entry ({dtype_name(dtype)}, "
            f"shape {list(shape)}) needs {nbytes}; the offload folder is stale or corrupted: offload again."
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    storage = map_file(path, nbytes)
    if storage is None:
        return read_bytes(path, 0, nbytes).view(dtype).reshape(shape)
    return _view(storage, dtype, shape, nbytes)


def _layout(path: Path, weight_info: Mapping[str, Any]) -> tuple[torch.dtype, tuple[int, ...], int]:
    """A plain entry's dtype, shape and byte count (raises ValueError naming ``path`` for a bad dtype)."""
    dtype = parse_dtype(weight_info.get("dtype"), f"Offload entry for {str(path)!r}")
    shape = parse_shape(weight_info.get("shape"), f"Offload entry for {str(path)!r}")
    return dtype, shape, dtype.itemsize * int(torch.Size(shape).numel())


def _view(storage: torch.UntypedStorage, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,)).view(dtype).reshape(shape)


def mapped_offloaded_weight(weight_file: str | os.PathLike, weight_info: object) -> torch.Tensor | None:
    """A plain ``.dat`` entry as a zero-copy view of its mapped file, never read: None when it would have
    to be read instead (unprotected, the lease budget spent), is another kind of entry (safetensors,
    quantized, subclass), is empty, or does not match its file (its own read then raises, naming it)."""
    if not isinstance(weight_info, Mapping) or any(k in weight_info for k in ("safetensors_file", "subclass",
                                                                                "quantization")):
        return None
    path = Path(weight_file)
    try:
        dtype, shape, nbytes = _layout(path, weight_info)
        if nbytes == 0 or not path.is_file() or path.stat().st_size != nbytes:
            return None
        storage = map_file(path, nbytes)
    except (OSError, ValueError, TypeError):
        return None
    return None if storage is None else _view(storage, dtype, shape, nbytes)


def _read_subclass(weight_file: Path, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """A wrapper tensor subclass entry: its parts (``<name>#<part>.dat`` beside ``weight_file``), rebuilt."""
    name = weight_file.name.removesuffix(".dat")  # the last part of the tensor name: its parts lie beside it
    parts = {
        path: load_offloaded_weight(weight_file.with_name(f"{part}.dat"), info)
        for path, (part, info) in part_files(weight_file.parent, name, weight_info).items()
    }
    return rebuild(weight_info, name, parts)


def _safetensors_path(info: Mapping[str, Any], folder: Path | None) -> str:
    """The file an entry points into.

    A relative path is taken from the working directory, as the incumbent reads it (transformers
    and peft write such paths for a checkpoint given as a relative folder); when no file is there,
    from ``folder`` (an offload folder moved with the files it points to).
    """
    path = str(info["safetensors_file"])
    if folder is not None and not Path(path).is_absolute() and not Path(path).is_file():
        path = str(folder / path)
    return path


def _read_safetensors_entry(
    info: Mapping[str, Any], key: str, cache: dict[str, SafetensorsFile], folder: Path | None = None
) -> torch.Tensor:
    """Read an entry pointing into a safetensors file (see :func:`_safetensors_path` for relative paths)."""
    path = _safetensors_path(info, folder)
    handle = cache.get(path)
    if handle is None:
        if not Path(path).is_file():
            raise FileNotFoundError(
                f"Offload entry {key!r} points to {path!r}, which is missing; load the checkpoint again."
            )
        handle = cache[path] = SafetensorsFile(path)
    tensor = handle.tensor(info.get("weight_name", key))
    if "dtype" in info:
        dtype = parse_dtype(info["dtype"], f"offload entry {key!r}")
        if tensor.dtype != dtype:
            tensor = tensor.to(dtype)
    return tensor


def load_offload_index(folder: str | os.PathLike) -> dict[str, dict]:
    """The ``index.json`` of an offload folder (empty dict if there is none).

    Raises:
        ValueError: the index exists but is not valid JSON, or not a JSON object (names the file).
    """
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        return {}
    try:
        index = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(
            f"Offload index {str(path)!r} is corrupted ({err}); delete the offload folder and reload."
        ) from err
    if not isinstance(index, dict):
        raise ValueError(
            f"{str(path)!r} is not an offload index (it holds a JSON {type(index).__name__}, not an object of "
            "entries); pass an offload_folder of its own (or move that index.json away)."
        )
    return index


def is_offload_index(index: object) -> bool:
    """True if ``index`` (a parsed ``index.json``) is an offload index: a JSON object whose every entry is a JSON
    object with a ``"dtype"`` (a ``.dat`` entry, or a pointer into a safetensors file)."""
    return isinstance(index, Mapping) and all(isinstance(e, Mapping) and "dtype" in e for e in index.values())


def entry_files(name: str, entry: object) -> set[str]:
    """The names whose ``.dat`` files (``dat_path(folder, n)``) index entry ``name`` describes.

    A plain or quantized entry: ``<name>.dat`` (a quantized one also ``<name>@<part>.dat`` for
    each part but its data); a wrapper subclass entry: ``<name>#<part>.dat`` for each part, and
    not ``<name>.dat``; a pointer into a safetensors file: none.
    """
    if not isinstance(entry, Mapping) or "safetensors_file" in entry or "dtype" not in entry:
        return set()
    if is_subclass_entry(entry):
        parts = entry["subclass"].get("parts")
        return {part_name(name, str(p)) for p in parts} if isinstance(parts, Mapping) else set()
    quantization = entry.get("quantization")
    parts = quantization.get("parts") if isinstance(quantization, Mapping) else None
    extra = {f"{name}{QUANTIZED_PART_SEP}{p}" for p in parts if p != "data"} if isinstance(parts, Mapping) else set()
    return {name} | extra


def _part_names(folder: Path, name: str, listings: dict[Path, dict[str, list[str]]]) -> list[str]:
    """The names of the existing files ``<name>#<part>.dat`` / ``<name>@<part>.dat`` (any part) in ``folder``."""
    path = dat_path(folder, name)
    if path.parent not in listings:
        by_stem: dict[str, list[str]] = {}
        try:
            files = [f for f in os.listdir(path.parent) if f.endswith(".dat")]
        except OSError:
            files = []
        for file in files:
            for i, char in enumerate(file[:-4]):
                if char in (PART_SEP, QUANTIZED_PART_SEP):
                    by_stem.setdefault(file[:i], []).append(file[i:-4])
        listings[path.parent] = by_stem
    return [name + suffix for suffix in sorted(listings[path.parent].get(path.name[:-4], []))]


def files_no_offload_wrote(folder: str | os.PathLike, names: list[str]) -> list[Path]:
    """The files that offloading ``names`` into ``folder`` could replace and that are not an offload's own.

    An offload writes ``index.json``, and for a tensor ``name`` ``<name>.dat``, or its parts
    ``<name>#<part>.dat`` (a wrapper tensor subclass) or ``<name>@<part>.dat`` (a quantized
    weight).  An existing ``index.json`` is an offload's own when it is a JSON object of offload
    entries (each a JSON object with a ``"dtype"``); an existing ``.dat`` file when that index
    has an entry describing it (see :func:`entry_files`).  Anything else (a user's
    ``index.json``, a stray ``.dat``, ``<name>#<anything>.dat`` or ``<name>@<anything>.dat``) is
    returned.

    Args:
        folder: the offload folder.
        names: tensor names that may be written as ``.dat`` files (or as parts).

    Returns:
        Paths of the existing files that are not offload output, ``index.json`` first.
    """
    folder = Path(folder)
    index_path = folder / INDEX_NAME
    index: object = {}
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
        except (ValueError, UnicodeDecodeError, OSError):
            index = None
    ours = is_offload_index(index)
    foreign = [] if ours or not index_path.exists() else [index_path]
    owned = {n for name, entry in index.items() for n in entry_files(name, entry)} if ours else set()
    listings: dict[Path, dict[str, list[str]]] = {}
    for name in names:
        for candidate in [name, *_part_names(folder, name, listings)]:
            path = dat_path(folder, candidate)
            if candidate not in owned and path.exists():
                foreign.append(path)
    return foreign
