"""Checkpoints: resolve the files → read tensor headers → iterate tensors lazily.

Formats:

- ``.safetensors``: validated with the ``safetensors`` library (``safe_open``), then the
  whole file is mapped once (``torch.UntypedStorage.from_file``, private mapping) and every
  tensor is a zero-copy view at the byte offsets of the header.  Nothing is read until a
  page is touched, so loading on CPU runs at page-cache speed and a tensor used in the
  same dtype on CPU costs no copy (some safetensors versions copy in ``get_tensor``;
  these views do not depend on the version).  The file is mapped only where a rewrite of
  it cannot harm the process (:mod:`bigmodel.core.file_maps`); elsewhere each tensor is
  read into memory.
- torch pickles (``.bin``/``.pt``/``.pth``): ``torch.load(weights_only=True)`` always, with
  ``mmap=True`` for the zip format where the mapping is protected.  A pickle that needs to
  run code is refused.  Their tensors are copied where they stay on CPU (the loader does):
  ``torch.save`` over the file holds the GIL while it truncates it, so no protection of a
  mapping could let it finish.
- a sharded checkpoint's ``.json`` index and folders (hub cache snapshots included): which
  files make up a checkpoint is decided in :mod:`bigmodel.checkpoints.resolve`.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import warnings
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.devices import DeviceSpec, torch_device
from ..core.file_maps import is_mapped, map_file, read_bytes
from ..core.tensors import device_of
from ..core.warn import caller_stacklevel
from .access import check_readable
from .resolve import (  # noqa: F401  (resolution lives in .resolve; these names stay importable here)
    INDEX_SUFFIX,
    PICKLE_SUFFIXES,
    SAFETENSORS_SUFFIX,
    STANDARD_NAMES,
    resolve_checkpoint_files,
)
from .torch_pickle import load_torch_file

logger = logging.getLogger(__name__)


# safetensors dtype codes (format spec) → torch dtypes; codes torch lacks are left out.
_ST_CODES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "C64": "complex64", "C128": "complex128",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in _ST_CODES.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives and what it is, known without reading its data.

    Attributes:
        name: key in the checkpoint.
        dtype: stored dtype.
        shape: stored shape.
        file: the file holding it.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path

    @property
    def is_safetensors(self) -> bool:
        return self.file.suffix == SAFETENSORS_SUFFIX


# ---------------------------------------------------------------- safetensors


class SafetensorsFile:
    """One ``.safetensors`` file mapped into memory once; tensors are zero-copy views.

    Where the mapping cannot be protected (:func:`bigmodel.core.file_maps.map_file` says so),
    each tensor is read into memory instead.

    Args:
        path: the file.

    Raises:
        PermissionError / FileNotFoundError / OSError: the file cannot be opened (names it and the fix).
        ValueError: the file is truncated, its header is corrupted, or TensorFlow/Flax saved it (names the file).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        check_readable(self.path)
        self._identity = _identity(self.path)
        self.entries, self._data_start = read_header(self.path)
        self._storage: torch.UntypedStorage | None = None
        self._mapping_decided = False

    def infos(self) -> dict[str, TensorInfo]:
        """Name → :class:`TensorInfo` for every tensor of the file, in offset order."""
        return {
            name: TensorInfo(name, SAFETENSORS_DTYPES[e["dtype"]], tuple(e["shape"]), self.path)
            for name, e in self.entries.items()
        }

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a view of the mapped file (copied if misaligned, read if not mapped).

        Raises:
            KeyError: ``name`` is not in the file.
            ValueError: the file changed since its header was read, or ends early (names the file).
        """
        if name not in self.entries:
            raise KeyError(f"{name!r} is not a tensor of {str(self.path)!r}.")
        entry = self.entries[name]
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = tuple(entry["shape"])
        start, end = entry["data_offsets"]
        if end == start:
            return torch.empty(shape, dtype=dtype)
        offset = self._data_start + start
        storage = self._mapping()
        if storage is None:
            return read_bytes(self.path, offset, end - start, self._check_unchanged).view(dtype).reshape(shape)
        itemsize = dtype.itemsize
        if offset % itemsize == 0:
            return torch.empty(0, dtype=dtype).set_(storage, offset // itemsize, shape)
        logger.debug("%s: tensor %r is misaligned in the file; copying it.", self.path, name)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (end - start,))
        return raw.clone().view(dtype).reshape(shape)

    def _mapping(self) -> torch.UntypedStorage | None:
        if not self._mapping_decided:
            self._check_unchanged(self.path.stat())
            self._storage = map_file(self.path, self._identity[2])
            self._mapping_decided = True
        return self._storage

    def _check_unchanged(self, st: os.stat_result) -> None:
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != self._identity:
            raise ValueError(
                f"Checkpoint file {str(self.path)!r} changed after its header was read (it was replaced or "
                "rewritten); load it again once it is complete."
            )

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.entries:
            yield name, self.tensor(name)


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """Validate ``path`` with safetensors, then return its entries (offset order) and data start (bytes).

    Raises:
        PermissionError / FileNotFoundError / OSError: the file cannot be opened (names it and the fix).
        ValueError: the file is truncated, its header is corrupted, or TensorFlow/Flax saved it (names the file).
    """
    check_readable(path)  # safetensors words an unreadable file as a missing one, then we would call it corrupted
    try:
        with safe_open(str(path), framework="pt") as handle:
            names = list(handle.keys())
    except Exception as err:  # safetensors raises its own SafetensorError (not exported everywhere)
        raise ValueError(
            f"Checkpoint file {str(path)!r} is not a valid safetensors file ({err}); it may be truncated or "
            "corrupted: download or save it again."
        ) from err
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    _check_torch_format(path, header.pop("__metadata__", None))
    if set(header) != set(names):
        raise ValueError(f"Checkpoint file {str(path)!r} has an inconsistent header; save it again.")
    unknown = sorted({e["dtype"] for e in header.values()} - set(SAFETENSORS_DTYPES))
    if unknown:
        raise ValueError(f"Checkpoint file {str(path)!r} uses dtypes this torch cannot read: {unknown}; upgrade torch.")
    ordered = dict(sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]))
    return ordered, 8 + length


def _check_torch_format(path: Path, metadata: object) -> None:
    """Refuse a file whose metadata says TensorFlow or Flax wrote it (as accelerate does).

    Such files hold another framework's names and layouts (transposed kernels); loaded as
    PyTorch tensors they fill nothing or the wrong thing.  No metadata, ``"pt"`` or another
    ``format`` (mlx, custom tools) is read as PyTorch tensors.

    Raises:
        ValueError: ``format`` is ``"tf"`` or ``"flax"`` (names the file and the format).
    """
    written_by = metadata.get("format") if isinstance(metadata, dict) else None
    if written_by in _OTHER_FRAMEWORKS:
        raise ValueError(
            f"Checkpoint file {str(path)!r} was saved by {_OTHER_FRAMEWORKS[written_by]} (metadata format "
            f"{written_by!r}); its tensor names and layouts are not PyTorch's. Load the model's PyTorch "
            "weights instead (a file saved from PyTorch: metadata format 'pt' or none)."
        )


_OTHER_FRAMEWORKS = {"tf": "TensorFlow", "flax": "Flax"}


# ---------------------------------------------------------------- reading


def read_tensor_infos(
    files: Iterable[Path], keep_loaded: dict[Path, dict[str, torch.Tensor]] | None = None
) -> dict[str, TensorInfo]:
    """Name, dtype, shape and file of every tensor of a checkpoint, validating each file.

    Safetensors files are read from their header only; torch pickles are memory-mapped
    when possible.  A name in several files comes from the shard the checkpoint's index names
    for it (``files.shard_of``, see :class:`~bigmodel.checkpoints.resolve.CheckpointFiles`) when
    that shard holds it, else from its first file (a warning is logged either way).

    Args:
        files: the weight files (from :func:`resolve_checkpoint_files`).
        keep_loaded: if given, memory-mapped pickles loaded here are kept in it (path →
            tensors) so that :func:`iter_checkpoint_tensors` need not unpickle them again.

    Raises:
        ValueError / pickle.UnpicklingError: a file is corrupted or unsafe (names the file); the
            index putting a tensor in a shard that does not hold it is a ``UserWarning`` (names both).
    """
    infos: dict[str, TensorInfo] = {}
    shard_of = getattr(files, "shard_of", {})
    held: dict[Path, set[str]] = {}
    for path in files:
        if path.suffix == SAFETENSORS_SUFFIX:
            file_infos = SafetensorsFile(path).infos()
        else:
            tensors = load_torch_file(path)
            file_infos = {n: TensorInfo(n, t.dtype, tuple(t.shape), path) for n, t in tensors.items()}
            if keep_loaded is not None and zipfile.is_zipfile(path):  # mapped, so keeping it costs no RAM
                keep_loaded[path] = tensors
            del tensors
        held[path] = set(file_infos)
        for name, info in file_infos.items():
            if name in infos:
                indexed = shard_of.get(name) == path
                logger.warning("Tensor %r is in both %s and %s; using %s.", name, infos[name].file, path,
                               "the one the index names" if indexed else "the first")  # fmt: skip
                if not indexed:
                    continue
            infos[name] = info
    _check_index_agrees(shard_of, held, infos)
    return infos


def _check_index_agrees(
    shard_of: Mapping[str, Path], held: Mapping[Path, set[str]], infos: Mapping[str, TensorInfo]
) -> None:
    """Warn (``UserWarning``) naming the tensors the index puts in a shard whose header lacks them.

    Checked from the headers already read (no tensor data).  Such a tensor is loaded from the shard
    that holds it, as transformers and the incumbent load every tensor of every indexed shard; one
    in no shard is left to the missing-keys report.  A tensor in several shards, the indexed one
    among them, is read from the indexed one (see :func:`read_tensor_infos`).
    """
    wrong = []
    for name, shard in shard_of.items():
        if shard not in held or name in held[shard]:
            continue
        found = infos.get(name)
        where = f"read from {found.file.name!r}" if found is not None else "in no shard"
        wrong.append(f"{name!r} (indexed in {shard.name!r}, {where})")
    if wrong:
        warnings.warn(
            f"The checkpoint's index in {str(next(iter(held)).parent)!r} and its shards disagree on {len(wrong)} "
            f"tensor(s): {', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}; regenerate the index "
            "(or download the checkpoint again).", UserWarning, stacklevel=caller_stacklevel(),
        )


def iter_file_tensors(
    path: Path, loaded: dict[Path, dict[str, torch.Tensor]] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for one weights file, lazily (CPU tensors, memory-mapped when possible).

    ``loaded`` holds pickles already loaded by :func:`read_tensor_infos` (consumed here).
    """
    if path.suffix == SAFETENSORS_SUFFIX:
        yield from SafetensorsFile(path)
    else:
        tensors = (loaded or {}).pop(path, None) or load_torch_file(path)
        while tensors:
            name = next(iter(tensors))
            yield name, tensors.pop(name)


def iter_checkpoint_tensors(
    files: Iterable[Path],
    loaded: dict[Path, dict[str, torch.Tensor]] | None = None,
    sources: Mapping[str, Path] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every file, one tensor at a time, on CPU.

    Tensors are views of memory-mapped files where the format allows (safetensors, zip
    pickles).  A name in several files is yielded once: from its file in ``sources`` (name →
    file, the ``file`` of each :func:`read_tensor_infos` entry), else from its first file.
    ``loaded``: see :func:`read_tensor_infos`.
    """
    seen: set[str] = set()
    for path in files:
        path = Path(path)
        for name, tensor in iter_file_tensors(path, loaded):
            chosen = sources.get(name) if sources is not None else None
            if name not in seen and (chosen is None or chosen == path):
                seen.add(name)
                yield name, tensor


def load_state_dict(
    checkpoint_file: str | os.PathLike, device_map: Mapping[str, DeviceSpec] | None = None
) -> dict[str, torch.Tensor]:
    """Load one weights file as a state dict, tensor by tensor.

    Args:
        checkpoint_file: a ``.safetensors`` file (tensors are zero-copy views of the mapped
            file where the mapping is protected) or a torch pickle (loaded with
            ``weights_only=True``; its tensors are copies in memory).
        device_map: optional map module/tensor name → device; each tensor goes to its device
            (``"disk"`` and names the map does not cover stay on CPU).

    Returns:
        Name → tensor.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError / pickle.UnpicklingError: the file is corrupted, unsafe or of an unknown type, or a
            safetensors file saved by TensorFlow or Flax (its metadata ``format`` is ``"tf"``/``"flax"``).
    """
    path = Path(checkpoint_file)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint file {str(path)!r} does not exist; pass the path of one weights file.")
    if path.suffix not in (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES):
        raise ValueError(f"{str(path)!r} is not a .safetensors, .bin, .pt or .pth file; use load_checkpoint_in_model.")
    state_dict = {}
    for name, tensor in iter_file_tensors(path):
        if path.suffix != SAFETENSORS_SUFFIX and is_mapped(tensor):
            tensor = tensor.clone()  # pickles are never left mapped (see the module's docstring)
        if device_map is not None:
            try:
                device = device_of(name, device_map)
            except KeyError:
                device = "cpu"
            if device not in ("cpu", "disk", "meta"):
                tensor = tensor.to(torch_device(device))
        state_dict[name] = tensor
    return state_dict
