"""The offload folder: writing ``index.json`` + raw ``.dat`` files, and a read-only Mapping over it.

The format and the reading of one tensor are in :mod:`bigmodel.offload.format` (re-exported
here).  Writes are atomic: ``.dat`` files go through a temporary name; before they replace
older files of the same names, those names are dropped from ``index.json``; the merged index
is written last.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoints.files import SafetensorsFile
from ..core.devices import DeviceSpec, torch_device
from ..core.file_maps import is_mapped
from ..core.subclasses import (
    check_flattenable,
    detached,
    flatten_tensor,
    is_tensor_subclass,
)
from ..core.tensors import set_module_tensor_to_device
from .folder_lock import folder_lock
from .format import (
    INDEX_NAME,
    _read_safetensors_entry,
    check_offload_index,
    dat_path,
    folder_path,
    dtype_name,
    load_offload_index,
    load_offloaded_weight,
    mapped_offloaded_weight,
    parse_dtype,
)
from .subclass_format import subclass_entry
from .writer import (
    OffloadWriter,
    atomic_write,
    index_to_merge,
    raw_bytes,
    space_checked,
    warn_replaced,
    write_index,
)

__all__ = [
    "INDEX_NAME", "OffloadWriter", "OffloadedWeightsLoader", "PrefixedDataset", "dat_path", "dtype_name",
    "extract_submodules_state_dict", "load_offload_index", "load_offloaded_weight", "load_offloaded_weights",
    "offload_state_dict", "offload_weight", "parse_dtype", "save_offload_index",
]  # fmt: skip

logger = logging.getLogger(__name__)


def offload_weight(
    weight: torch.Tensor, weight_name: str, offload_folder: str | os.PathLike, index: dict | None = None
) -> dict:
    """Write one tensor to ``<offload_folder>/<weight_name>.dat`` (raw bytes, C order).

    A wrapper tensor subclass (torchao's quantized weights) is written as its plain parts,
    ``<weight_name>#<part>.dat``, and an entry that rebuilds it (see
    :mod:`bigmodel.offload.subclass_format`); nothing is pickled.

    Args:
        weight: the tensor (any device, any dtype; bf16/fp8 stored bit-exactly).
        weight_name: its name; also the file name.
        offload_folder: the folder (created if needed).
        index: an index dict to add the entry to (not written to disk; see :func:`save_offload_index`).

    Returns:
        ``index`` (or a new dict) with ``weight_name → {"dtype", "shape"}`` added.

    Raises:
        ValueError: ``weight_name`` would leave the folder (see :func:`dat_path`).
        TypeError: ``weight`` is a tensor subclass that cannot be stored as plain tensors (names it and the fix).
    """
    folder = folder_path(offload_folder)
    dat_path(folder, weight_name)  # refuses names leaving the folder before anything is created
    check_flattenable(weight, weight_name)
    index = {} if index is None else index
    if is_tensor_subclass(weight):  # its plain parts, each in its own file, and one entry to rebuild it
        entry, parts = subclass_entry(weight_name, weight)
        for part, value in parts.items():
            offload_weight(value, part, folder)
        index[weight_name] = entry
        return index
    folder.mkdir(parents=True, exist_ok=True)
    path = dat_path(folder, weight_name, create=True)
    data = raw_bytes(weight)
    with space_checked(folder, path.name, len(data)):
        atomic_write(path, lambda f: f.write(memoryview(data)))
    index[weight_name] = {"dtype": dtype_name(weight.dtype), "shape": list(weight.shape)}
    return index


def save_offload_index(index: Mapping[str, dict] | None, offload_folder: str | os.PathLike) -> None:
    """Merge ``index`` into ``<offload_folder>/index.json`` and replace it atomically.

    Args:
        index: tensor name → entry, as :func:`offload_weight` builds it; entries replace those
            of the same names already in the file.  None or empty writes nothing.
        offload_folder: the offload folder (it must exist when there is something to write).

    Raises:
        ValueError: the existing ``index.json`` is not a valid offload index (names the file); nothing is written.
        OSError: the folder cannot be written (the previous index is left as it was).

    Warns:
        UserWarning: entries of the same names but another shape or dtype were replaced (see
            :func:`bigmodel.offload.writer.warn_replaced`).
    """
    if not index:
        return
    folder = folder_path(offload_folder)
    previous = index_to_merge(folder)
    write_index({**previous, **index}, folder)
    warn_replaced(folder, previous, index)


def load_offloaded_weights(model: nn.Module, index: Mapping[str, dict] | None, offload_folder: str | os.PathLike) -> None:
    """Put every tensor of an offload folder back into ``model``, on the CPU (copies: the folder may then go).

    Used by diffusers after loading with ``offload_state_dict``.  A ``<name>.SCB`` entry is
    not a tensor of its own: it is passed as the 8-bit statistics of the ``<name>.weight``
    beside it.

    Args:
        model: the model; its parameters/buffers named in ``index`` may be on ``meta``.
        index: tensor name → offload entry (``{"dtype", "shape"}`` for ``<name>.dat`` files, or
            a safetensors pointer).  None or empty loads nothing.
        offload_folder: the folder holding the ``.dat`` files.

    Raises:
        FileNotFoundError: a ``.dat`` file is missing (names it).
        ValueError: an entry does not match its file, or names no tensor of ``model``.
    """
    if not index:
        return
    folder = folder_path(offload_folder)
    for name, info in index.items():
        if name.rpartition(".")[2] == "SCB":
            continue
        statistics = None
        if name.endswith("weight") and (scb := name[: -len("weight")] + "SCB") in index:
            statistics = load_offloaded_weight(dat_path(folder, scb), index[scb]).clone()
        # A copy, not a map of the file: callers delete the folder right after (diffusers does).
        value = load_offloaded_weight(dat_path(folder, name), info).clone()
        set_module_tensor_to_device(model, name, "cpu", value=value, fp16_statistics=statistics)


def offload_state_dict(save_dir: str | os.PathLike, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Write every tensor of ``state_dict`` to ``save_dir`` (``.dat`` files + merged ``index.json``).

    Raises:
        PermissionError / OSError: ``save_dir`` cannot be written (the previous index is left as it was).
        TypeError: a value is not a tensor (names its key; nothing is written).
    """
    for name, value in state_dict.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"offload_state_dict: state_dict[{name!r}] is a {type(value).__name__}, not a torch.Tensor; pass a "
                "dict of tensor name → torch.Tensor (drop or convert the other values)."
            )
    with folder_lock(save_dir):  # no other offload writes the folder meanwhile
        writer = OffloadWriter(save_dir)
        try:
            for name, tensor in state_dict.items():
                writer.write(name, tensor)
            writer.commit()
        except BaseException:
            writer.abort()
            raise


def extract_submodules_state_dict(state_dict: Mapping[str, Any], submodule_names: Iterable[str]) -> dict[str, Any]:
    """The entries of ``state_dict`` under any of ``submodule_names`` (``""``: the whole model).

    Returns:
        A new dict: each name's entries (the name or below it) in turn, as accelerate orders them.
    """
    members: dict[str, list[str]] = {name: [] for name in submodule_names}
    for key, parts in ((key, key.split(".")) for key in state_dict):
        for end in range(len(parts), -1, -1):  # the key, each enclosing module's name, then "" (the model)
            members.get(".".join(parts[:end]), []).append(key)
    return {key: state_dict[key] for keys in members.values() for key in keys}


class OffloadedWeightsLoader(Mapping):
    """Read-only Mapping name → tensor over in-memory weights and an offload folder.

    Each file of the folder (a ``.dat`` file, a safetensors file) is memory-mapped once, on
    the first read of a tensor in it, and stays mapped while the loader lives: later reads
    of that tensor return a new view of the same mapping (no system call, no page fault on
    pages already touched).  The mappings are released when the loader is garbage collected
    (it holds no reference back to any module, so this happens as soon as the dispatched
    model that owns it is deleted).  A file replaced on disk after its first read is not seen;
    one rewritten in place has its mappings copied into memory first (Linux leases, see
    :mod:`bigmodel.core.file_maps`).  Where a file cannot be mapped safely, each read is a fresh
    copy and nothing is kept.
    Thread-safe: a background reader (the prefetcher) and the forward may read at once.

    Args:
        state_dict: tensors kept in memory (returned as they are).
        save_folder: an offload folder; its ``index.json`` is read when ``index`` is None.
        index: the folder's index (name → entry), if already in memory.
        device: if given, tensors read from disk are moved there; otherwise they are
            zero-copy memory-mapped CPU tensors (``.dat`` and safetensors entries alike).

    Attributes:
        save_folder: the folder as the caller gave it (a ``str`` stays a ``str``), or None.

    Raises:
        FileNotFoundError: ``index`` is None and ``save_folder`` has no ``index.json`` (names the file).
        OffloadIndexError: an entry of the index is not an object, or its dtype or shape is invalid (a
            ``ValueError``; names the key, the index file, the value and the fix; see
            :func:`bigmodel.offload.format.check_offload_index`).  No entry is read before this check.
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
        self.save_folder = save_folder  # as given (str stays str): callers read and join it
        self._folder = None if save_folder is None else folder_path(save_folder, "save_folder")
        if index is None and self._folder is not None:
            if not (self._folder / INDEX_NAME).is_file():
                raise FileNotFoundError(
                    f"OffloadedWeightsLoader: {str(self._folder / INDEX_NAME)!r} does not exist; pass the "
                    "offload folder that holds it (as written by offload_state_dict), or index=."
                )
            index = load_offload_index(self._folder)
        self.index = dict(index or {})
        where = "passed as index=" if self._folder is None else repr(str(self._folder / INDEX_NAME))
        check_offload_index(self.index, where)  # before any entry is read
        if self._folder is None and any("safetensors_file" not in e for e in self.index.values()):
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
            tensor = detached(tensor)  # a new view: callers never change the cached tensor's metadata
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
                return detached(cached)
            info = self.index[key]
            if "safetensors_file" in info:
                tensor = _read_safetensors_entry(info, key, self._files, self._folder)
            else:
                tensor = load_offloaded_weight(dat_path(self._folder, key), info)  # type: ignore[arg-type]
            if tensor.numel() and not _file_backed(tensor):
                return tensor  # a cast, realigned or unprotected copy: not kept (it is not file-backed memory)
            self._mapped[key] = tensor
            return detached(tensor)

    def map_dat_files(self) -> None:
        """Map the file of every ``.dat`` entry now (no page is read), as a first read would: a file
        replaced later (another offload into the same folder writes a new file under the name) is then
        not seen by this loader, whose model keeps its own values.  An entry that cannot be mapped
        here (another kind of entry, an unprotected file, the lease budget spent) is left to its first
        read; no file is read here."""
        if self._folder is None or self.device is not None:
            return
        with torch.inference_mode(False):  # kept views are never inference tensors (see _map)
            for key, info in self.index.items():
                if key in self.state_dict or key in self._mapped:
                    continue
                try:
                    tensor = mapped_offloaded_weight(dat_path(self._folder, key), info)  # never reads the file
                except ValueError:  # a name dat_path refuses: its first read raises, naming it
                    continue
                if tensor is not None:
                    with self._lock:
                        self._mapped.setdefault(key, tensor)

    def value_token(self, key: str) -> torch.Tensor | None:
        """The tensor ``self[key]`` is read from, for identity checks only (never change it or hand it out):
        the in-memory entry, or the kept view of the mapped file; the same object while the value is.
        None when each read makes a new copy (``device`` set, a file not mapped) or ``key`` was not read yet."""
        if self.device is not None:
            return None
        value = self.state_dict.get(key)
        return value if value is not None else self._mapped.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self.state_dict or key in self.index

    def __iter__(self) -> Iterator[str]:
        return iter(self.all_keys)

    def __len__(self) -> int:
        return len(self.all_keys)


def _file_backed(tensor: torch.Tensor) -> bool:
    """True if ``tensor`` (every part of a wrapper subclass) is a view of a file mapping."""
    if is_tensor_subclass(tensor):
        parts, _ = flatten_tensor(tensor)
        return all(not part.numel() or is_mapped(part) for part in parts.values())
    return is_mapped(tensor)


class PrefixedDataset(Mapping):
    """Mapping view of ``dataset`` restricted to keys starting with ``prefix``: lookups add the prefix.

    ``PrefixedDataset(weights, "model.layers.0.")["mlp.up.weight"]`` is
    ``weights["model.layers.0.mlp.up.weight"]``.  Iterating gives the dataset's full names under the
    prefix, as accelerate's does (code reads ``weights_map.dataset[next(iter(weights_map))]``).

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
        return (key for key in self.dataset if key.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for key in self.dataset if key.startswith(self.prefix))


def value_token_getter(weights_map: Mapping[str, Any]) -> tuple[Callable[[str], Any], str] | None:
    """How to tell, without reading it, whether ``weights_map[name]`` is still the same value.

    Args:
        weights_map: a weights map: a dict, an :class:`OffloadedWeightsLoader`, or
            :class:`PrefixedDataset` views of one.

    Returns:
        ``(get, prefix)``: ``get(prefix + name)`` is an object that stays the same (identity; compare
        its ``data_ptr()`` too for a dict entry a caller may re-point) while ``weights_map[name]`` views
        the same memory, or None for a name not read yet.  None for any other map (it cannot tell).
    """
    prefix = ""
    while type(weights_map) is PrefixedDataset:
        prefix = weights_map.prefix + prefix
        weights_map = weights_map.dataset
    if type(weights_map) is dict:
        return weights_map.get, prefix
    if type(weights_map) is OffloadedWeightsLoader and weights_map.device is None:
        return weights_map.value_token, prefix
    return None
