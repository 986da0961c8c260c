"""The offload folder: ``index.json`` + raw ``.dat`` files, and a read-only Mapping over it.

Format (shared with the ecosystem): ``index.json`` maps each tensor name to either

- ``{"dtype": "bfloat16", "shape": [4096, 4096]}`` with the tensor's bytes in ``<name>.dat``
  (raw, C order, no header; any dtype, bf16/fp8 included, round-trips bit-exactly), or
- ``{"safetensors_file": path, "weight_name": key, "dtype": "float16"}`` (bigmodel also
  writes ``"shape"``) pointing into an existing safetensors file, which is never rewritten.

Reads are memory maps: a CPU tensor from the folder is a zero-copy view of its file.
Writes are atomic: ``.dat`` files go through a temporary name, and ``index.json`` is
replaced in one ``os.replace`` after everything else is on disk, merged with any existing index.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ._checkpoint import SafetensorsFile
from ._devices import DeviceSpec, torch_device

logger = logging.getLogger(__name__)

INDEX_NAME = "index.json"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"`` (the spelling used in ``index.json``)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype:
    """``"bfloat16"`` → ``torch.bfloat16``.

    Raises:
        ValueError: not a torch dtype name (names ``where`` the name was found).
    """
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype name (e.g. 'float16', 'bfloat16').")
    return dtype


def _atomic_write(path: Path, write: Any) -> None:
    """Write ``path`` through a temporary file in the same folder and ``os.replace`` it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _raw_bytes(weight: torch.Tensor):
    """The tensor's bytes in C order as a numpy uint8 array (works for every dtype)."""
    flat = weight.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict:
    """Write one tensor to ``<offload_folder>/<weight_name>.dat`` (raw bytes, C order).

    Args:
        weight: the tensor (any device, any dtype; bf16/fp8 stored bit-exactly).
        weight_name: its name; also the file name.
        offload_folder: the folder (created if needed).
        index: an index dict to add the entry to (not written to disk; see :func:`save_offload_index`).

    Returns:
        ``index`` (or a new dict) with ``weight_name → {"dtype", "shape"}`` added.
    """
    folder = Path(offload_folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = _raw_bytes(weight)
    _atomic_write(folder / f"{weight_name}.dat", lambda f: f.write(memoryview(data)))
    index = {} if index is None else index
    index[weight_name] = {"dtype": dtype_name(weight.dtype), "shape": list(weight.shape)}
    return index


def load_offloaded_weight(weight_file: str | os.PathLike, weight_info: Mapping[str, Any]) -> torch.Tensor:
    """Read one offloaded tensor as a zero-copy, memory-mapped CPU tensor.

    Args:
        weight_file: the ``.dat`` file (ignored for entries pointing into a safetensors file).
        weight_info: its ``index.json`` entry (``{"dtype", "shape"}`` or ``{"safetensors_file", ...}``).

    Returns:
        The tensor on CPU (writable; writes are private to this process and never reach the file).

    Raises:
        ValueError: the entry is malformed or the file size does not match dtype × shape.
        FileNotFoundError: the file is missing.
    """
    if "safetensors_file" in weight_info:
        return _read_safetensors_entry(weight_info, Path(weight_file).stem, {})
    path = Path(weight_file)
    dtype = parse_dtype(weight_info.get("dtype", ""), f"offload entry for {str(path)!r}")
    shape = tuple(int(d) for d in weight_info.get("shape", ()))
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
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
    return torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8).view(dtype).reshape(shape)


def _safetensors_path(info: Mapping[str, Any], folder: Path | None) -> str:
    """The file an entry points into (a relative path is taken from ``folder``)."""
    path = str(info["safetensors_file"])
    if folder is not None and not Path(path).is_absolute():
        path = str(folder / path)
    return path


def _read_safetensors_entry(
    info: Mapping[str, Any], key: str, cache: dict[str, SafetensorsFile], folder: Path | None = None
) -> torch.Tensor:
    """Read an entry pointing into a safetensors file (a relative path is taken from ``folder``)."""
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
        ValueError: the index exists but is not valid JSON (names the file).
    """
    path = Path(folder) / INDEX_NAME
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(
            f"Offload index {str(path)!r} is corrupted ({err}); delete the offload folder and reload."
        ) from err


def save_offload_index(index: Mapping[str, dict], folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``<folder>/index.json`` and replace it atomically."""
    folder = Path(folder)
    merged = load_offload_index(folder)
    merged.update(index)
    text = json.dumps(merged, indent=2, sort_keys=True).encode()
    _atomic_write(folder / INDEX_NAME, lambda f: f.write(text))


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` (``.dat`` files + merged ``index.json``).

    Raises:
        PermissionError / OSError: ``save_dir`` cannot be written (the previous index is left as it was).
    """
    writer = OffloadWriter(save_dir)
    try:
        for name, tensor in state_dict.items():
            writer.write(name, tensor)
        writer.commit()
    except BaseException:
        writer.abort()
        raise


def extract_submodules_state_dict(state_dict: Mapping[str, Any], submodule_names: Iterable[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` that belong to any of ``submodule_names`` (the name or below it)."""
    names = list(submodule_names)
    return {
        key: value
        for key, value in state_dict.items()
        if any(not n or key == n or key.startswith(n + ".") for n in names)
    }


class OffloadWriter:
    """Stages tensors for an offload folder, then commits ``index.json`` atomically.

    ``.dat`` files are written under temporary names; :meth:`commit` renames them and
    then replaces the index, so a failure before the commit leaves the previous index
    (and its files) untouched.

    Args:
        folder: the offload folder (created if needed).

    Raises:
        PermissionError: the folder cannot be created or written (names the path and the fix).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.folder, prefix=".bigmodel-probe-")
            probe.close()
        except OSError as err:
            raise PermissionError(
                f"Offload folder {str(self.folder)!r} is not writable ({err.strerror or err}); "
                "pass an offload_folder you can write to."
            ) from err
        self.index: dict[str, dict] = {}
        self._staged: dict[str, Path] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Stage ``tensor`` as ``<name>.dat``."""
        data = _raw_bytes(tensor)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.", suffix=".dat.tmp")
        self._staged[name] = Path(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(data))
        self.index[name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}

    def duplicate(self, name: str, source: str) -> None:
        """Make ``name`` hold the same data as the already staged/pointed ``source`` (tied weights)."""
        entry = dict(self.index[source])
        if source in self._staged:
            tmp = self.folder / f".{name}.{os.getpid()}.dat.tmp"
            tmp.unlink(missing_ok=True)
            try:
                os.link(self._staged[source], tmp)
            except OSError:
                shutil.copyfile(self._staged[source], tmp)
            self._staged[name] = tmp
        self.index[name] = entry

    def point(
        self, name: str, safetensors_file: Path, weight_name: str, dtype: torch.dtype, shape: Iterable[int]
    ) -> None:
        """Record ``name`` as a view into an existing safetensors file (nothing is written)."""
        self.index[name] = {
            "safetensors_file": str(Path(safetensors_file).resolve()),
            "weight_name": weight_name,
            "dtype": dtype_name(dtype),
            "shape": list(shape),
        }

    def commit(self) -> None:
        """Move the staged ``.dat`` files into place, then replace ``index.json`` (merged)."""
        for name, tmp in list(self._staged.items()):
            os.replace(tmp, self.folder / f"{name}.dat")
            del self._staged[name]
        save_offload_index(self.index, self.folder)

    def abort(self) -> None:
        """Delete the staged files; the folder's index is left as it was."""
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()


class OffloadedWeightsLoader(Mapping):
    """Read-only Mapping name → tensor over in-memory weights and an offload folder.

    Each file of the folder (a ``.dat`` file, a safetensors file) is memory-mapped once, on
    the first read of a tensor in it, and stays mapped while the loader lives: later reads
    of that tensor return a new view of the same mapping (no system call, no page fault on
    pages already touched).  The mappings are released when the loader is garbage collected
    (it holds no reference back to any module, so this happens as soon as the dispatched
    model that owns it is deleted).  A file replaced on disk after its first read is not seen.
    Thread-safe: a background reader (the prefetcher) and the forward may read at once.

    Args:
        state_dict: tensors kept in memory (returned as they are).
        save_folder: an offload folder; its ``index.json`` is read when ``index`` is None.
        index: the folder's index (name → entry), if already in memory.
        device: if given, tensors read from disk are moved there; otherwise they are
            zero-copy memory-mapped CPU tensors (``.dat`` and safetensors entries alike).

    Raises:
        ValueError: ``index`` is given without ``save_folder`` while it holds ``.dat`` entries.
    """

    def __init__(
        self,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        save_folder: str | os.PathLike | None = None,
        index: Mapping[str, dict] | None = None,
        device: DeviceSpec | None = None,
    ) -> None:
        if state_dict is None and save_folder is None and index is None:
            raise ValueError("OffloadedWeightsLoader needs a state_dict, a save_folder or an index.")
        self.state_dict = {} if state_dict is None else state_dict
        self.save_folder = None if save_folder is None else Path(save_folder)
        if index is None and self.save_folder is not None:
            index = load_offload_index(self.save_folder)
        self.index = dict(index or {})
        if self.save_folder is None and any("safetensors_file" not in e for e in self.index.values()):
            raise ValueError("OffloadedWeightsLoader: the index has .dat entries; pass save_folder= to locate them.")
        self.device = device
        self.all_keys = list(self.state_dict) + [k for k in self.index if k not in self.state_dict]
        self._files: dict[str, SafetensorsFile] = {}
        self._mapped: dict[str, torch.Tensor] = {}  # name → zero-copy view of its mapped file
        self._lock = threading.Lock()

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.state_dict:
            return self.state_dict[key]
        tensor = self._mapped.get(key)
        if tensor is None:
            if key not in self.index:
                raise KeyError(key)
            tensor = self._map(key)
        else:
            tensor = tensor.detach()  # a new view: callers never change the cached tensor's metadata
        if self.device is not None:
            tensor = tensor.to(torch_device(self.device))
        return tensor

    def _map(self, key: str) -> torch.Tensor:
        """Read ``key`` from its file; keep it when it is a view of the file's mapping (no copy)."""
        with self._lock:
            cached = self._mapped.get(key)
            if cached is not None:
                return cached.detach()
            info = self.index[key]
            if "safetensors_file" in info:
                tensor = _read_safetensors_entry(info, key, self._files, self.save_folder)
                file_bytes = os.path.getsize(_safetensors_path(info, self.save_folder))
                if tensor.numel() and tensor.untyped_storage().nbytes() != file_bytes:
                    return tensor  # a cast or realigned copy: not kept (it is not file-backed memory)
            else:
                tensor = load_offloaded_weight(self.save_folder / f"{key}.dat", info)  # type: ignore[operator]
            self._mapped[key] = tensor
            return tensor.detach()

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


class PrefixedDataset(Mapping):
    """Mapping view of ``dataset`` restricted to keys starting with ``prefix``, with the prefix removed.

    ``PrefixedDataset(weights, "model.layers.0.")["mlp.up.weight"]`` is
    ``weights["model.layers.0.mlp.up.weight"]``.

    Args:
        dataset: any Mapping name → tensor (e.g. an :class:`OffloadedWeightsLoader`).
        prefix: the prefix added to every key on lookup.
    """

    def __init__(self, dataset: Mapping[str, Any], prefix: str) -> None:
        self.dataset = dataset
        self.prefix = prefix

    def __getitem__(self, key: str) -> Any:
        return self.dataset[f"{self.prefix}{key}"]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and f"{self.prefix}{key}" in self.dataset

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        return (key[n:] for key in self.dataset if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))
