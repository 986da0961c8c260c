"""The offload folder: writing ``index.json`` + raw ``.dat`` files, and a read-only Mapping over it.

The format and the reading of one tensor are in :mod:`bigmodel.offload.format` (re-exported
here).  Writes are atomic: ``.dat`` files go through a temporary name; before they replace
older files of the same names, those names are dropped from ``index.json``; the merged index
is written last.
"""

from __future__ import annotations

import copy
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

from ..checkpoints.files import SafetensorsFile
from ..core.devices import DeviceSpec, torch_device
from .format import (
    INDEX_NAME,
    _read_safetensors_entry,
    _safetensors_path,
    dat_path,
    dtype_name,
    load_offload_index,
    load_offloaded_weight,
    parse_dtype,
)

__all__ = [
    "INDEX_NAME",
    "OffloadWriter",
    "OffloadedWeightsLoader",
    "PrefixedDataset",
    "dat_path",
    "dtype_name",
    "extract_submodules_state_dict",
    "load_offload_index",
    "load_offloaded_weight",
    "offload_state_dict",
    "offload_weight",
    "parse_dtype",
    "save_offload_index",
]

logger = logging.getLogger(__name__)


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

    Raises:
        ValueError: ``weight_name`` would leave the folder (see :func:`dat_path`).
    """
    folder = Path(offload_folder)
    dat_path(folder, weight_name)  # refuses names leaving the folder before anything is created
    folder.mkdir(parents=True, exist_ok=True)
    path = dat_path(folder, weight_name, create=True)
    data = _raw_bytes(weight)
    _atomic_write(path, lambda f: f.write(memoryview(data)))
    index = {} if index is None else index
    index[weight_name] = {"dtype": dtype_name(weight.dtype), "shape": list(weight.shape)}
    return index


def _write_index(index: Mapping[str, dict], folder: Path) -> None:
    text = json.dumps(index, indent=2, sort_keys=True).encode()
    _atomic_write(folder / INDEX_NAME, lambda f: f.write(text))


def save_offload_index(index: Mapping[str, dict], folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``<folder>/index.json`` and replace it atomically."""
    folder = Path(folder)
    merged = load_offload_index(folder)
    merged.update(index)
    _write_index(merged, folder)


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

    ``.dat`` files are written under temporary names.  :meth:`commit` first drops from the
    index the entries whose files are about to be replaced, then renames the files, then
    writes the merged index: at every instant each index entry describes its file's bytes,
    and a failure before the commit leaves the previous index (and its files) untouched.

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
        """Stage ``tensor`` as ``<name>.dat``.

        Raises:
            ValueError: ``name`` would leave the folder (see :func:`dat_path`).
        """
        path = dat_path(self.folder, name, create=True)
        data = _raw_bytes(tensor)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        self._staged[name] = Path(tmp)
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(data))
        self.index[name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}

    def duplicate(self, name: str, source: str) -> None:
        """Make ``name`` hold the same data as the already staged/pointed ``source`` (tied weights)."""
        entry = dict(self.index[source])
        if source in self._staged:
            path = dat_path(self.folder, name, create=True)
            tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
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
        """Move the staged ``.dat`` files into place, then replace ``index.json`` (merged).

        Entries of the previous index whose files are replaced are first dropped from it (one
        atomic write), so no index ever describes a file holding other bytes.
        """
        previous = load_offload_index(self.folder)
        replaced = [name for name in self._staged if name in previous]
        if replaced:
            _write_index({k: v for k, v in previous.items() if k not in self._staged}, self.folder)
        for name, tmp in list(self._staged.items()):
            os.replace(tmp, dat_path(self.folder, name))
            del self._staged[name]
        previous.update(self.index)
        _write_index(previous, self.folder)

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

    def __deepcopy__(self, memo: dict) -> OffloadedWeightsLoader:
        """A loader over the same (read-only) folder and index, with a copy of the in-memory tensors.

        The copy maps the files again when it first reads them; an entry stored into its
        ``state_dict`` never reaches the original.
        """
        return OffloadedWeightsLoader(
            state_dict=copy.deepcopy(self.state_dict, memo), save_folder=self.save_folder,
            index=copy.deepcopy(self.index, memo), device=self.device,
        )  # fmt: skip

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
        """Read ``key`` from its file; keep it when it is a view of the file's mapping (no copy).

        The kept view is made outside inference mode even when the read happens inside it (an
        inference tensor kept here would break every later forward that records gradients).
        """
        with self._lock, torch.inference_mode(False):
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
                tensor = load_offloaded_weight(dat_path(self.save_folder, key), info)  # type: ignore[arg-type]
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
