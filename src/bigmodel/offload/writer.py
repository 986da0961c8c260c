"""Writing an offload folder: atomic file writes, the index, and :class:`OffloadWriter` (stage, then commit)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.subclasses import check_flattenable, is_tensor_subclass
from ..core.warn import caller_stacklevel
from .format import (
    INDEX_NAME,
    dat_path,
    folder_path,
    dtype_name,
    is_offload_index,
    load_offload_index,
)
from .subclass_format import is_subclass_entry, part_files, part_name, subclass_entry

__all__ = ["OffloadWriter", "atomic_write", "index_to_merge", "raw_bytes", "space_checked", "warn_replaced",
           "write_index"]

_FULL = (errno.ENOSPC, errno.EDQUOT)  # a full file system, a full quota


@contextlib.contextmanager
def space_checked(folder: Path, what: str, size: int) -> Any:
    """Re-raise a full disk (or quota) inside the block as an ``OSError`` naming the folder, the bytes and the fix.

    The error keeps the system's ``errno`` (``ENOSPC`` / ``EDQUOT``); its text names ``folder``,
    ``what`` was written (a file name), ``size`` (bytes) and the bytes still free there.

    Raises:
        OSError: the block ran out of space (named as above), or failed otherwise (unchanged).
    """
    try:
        yield
    except OSError as error:
        if error.errno not in _FULL:
            raise
        try:
            free = f"{shutil.disk_usage(folder).free:,} bytes free there"
        except OSError:
            free = "free space unknown"
        raise OSError(
            error.errno,
            f"No space left in offload folder {str(folder)!r} to write {what} ({size:,} bytes; {free}): "
            f"{error.strerror or error}; free some space there or pass another offload_folder.",
        ) from error


def atomic_write(path: Path, write: Any) -> None:
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


def raw_bytes(weight: torch.Tensor):
    """The tensor's bytes in C order as a numpy uint8 array (works for every dtype)."""
    flat = weight.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def write_index(index: Mapping[str, dict], folder: Path) -> None:
    text = json.dumps(index, indent=2, sort_keys=True).encode()
    with space_checked(folder, INDEX_NAME, len(text)):
        atomic_write(folder / INDEX_NAME, lambda f: f.write(text))


def index_to_merge(folder: Path) -> dict[str, dict]:
    """The folder's ``index.json`` (``{}`` if none), checked to be an offload index before entries are merged into it.

    Raises:
        ValueError: ``index.json`` is not an offload index (a user's file: names the first entry that is not
            of the offload form, and the fix); nothing has been written.
    """
    index = load_offload_index(folder)  # a JSON object (it raises for anything else)
    if is_offload_index(index):
        return index
    key = next(k for k, e in index.items() if not is_offload_index({k: e}))
    what = f"its entry {key!r} is {json.dumps(index[key])[:60]}, not an object with a \"dtype\""
    raise ValueError(
        f"{str(folder / INDEX_NAME)!r} is not an offload index ({what}); bigmodel will not merge its offload "
        "entries into another file: pass an offload_folder of its own (or move that index.json away)."
    )


def warn_replaced(folder: Path, previous: Mapping[str, Any], new: Mapping[str, Any]) -> None:
    """Warn (``UserWarning``) if entries of ``new`` replace entries of ``previous`` of another shape or dtype.

    Rewriting the same model into its folder keeps every name's shape and dtype and is silent;
    another shape or dtype under the same name means the folder held another model's offload,
    whose other entries are still there (a folder mixing two models).
    """
    differing = [
        f"{name!r}: {previous[name].get('dtype')} {previous[name].get('shape')} -> {entry.get('dtype')} "
        f"{entry.get('shape')}"
        for name, entry in new.items()
        if name in previous
        and (previous[name].get("dtype"), previous[name].get("shape")) != (entry.get("dtype"), entry.get("shape"))
    ]
    if differing:
        others = len(set(previous) - set(new))
        entries = f"{others} other entr{'y' if others == 1 else 'ies'}"
        left = f", and its {entries} may still be that model's" if others else ""
        warnings.warn(
            f"Offload folder {str(folder)!r} held {len(differing)} tensor(s) under the same names with another "
            f"shape or dtype, now replaced ({'; '.join(differing[:3])}): it held another model's offload (or "
            f"this one's in another dtype){left}; use one offload_folder per model (or delete this one first).",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )


def check_writable(folder: str | os.PathLike) -> None:
    """Create ``folder`` if missing and write (and delete) a probe file in it.

    Raises:
        ValueError: ``folder`` is an empty string (see :func:`folder_path`).
        PermissionError: ``folder`` is a file, or cannot be created or written (names it and the fix).
        OSError: ``ENOSPC`` / ``EDQUOT``: the disk is full (see :func:`space_checked`).
    """
    folder = folder_path(folder)
    if folder.exists() and not folder.is_dir():
        raise PermissionError(
            f"Offload folder {str(folder)!r} is not writable: it is a file, not a folder; pass an "
            "offload_folder that names a folder (it is created if missing)."
        )
    try:
        with space_checked(folder, "a probe file", 0):
            folder.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=folder, prefix=".bigmodel-probe-")
            probe.close()
    except OSError as err:
        if err.errno in _FULL:
            raise
        raise PermissionError(
            f"Offload folder {str(folder)!r} is not writable ({err.strerror or err}); "
            "pass an offload_folder you can write to."
        ) from err


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
        ValueError: the folder's ``index.json`` is not an offload index (see :func:`index_to_merge`).
        OSError: ``ENOSPC`` / ``EDQUOT``, here or in :meth:`write` / :meth:`commit`: the disk is full
            (names the folder, the file and its bytes, the bytes free and the fix; see :func:`space_checked`).
    """

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = folder_path(folder)
        check_writable(self.folder)
        index_to_merge(self.folder)  # refuse a user's index.json before anything is written
        self.index: dict[str, dict] = {}
        self._staged: dict[str, Path] = {}
        self._owner: dict[str, str] = {}  # staged part file name → the subclass tensor it belongs to

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Stage ``tensor`` as ``<name>.dat`` (a wrapper tensor subclass: its parts, ``<name>#<part>.dat``).

        Raises:
            ValueError: ``name`` would leave the folder (see :func:`dat_path`).
            TypeError: ``tensor`` is a tensor subclass that cannot be stored as plain tensors (names it
                and the fix); nothing is staged for it.
        """
        check_flattenable(tensor, name)
        if is_tensor_subclass(tensor):
            entry, parts = subclass_entry(name, tensor)
            for part, value in parts.items():
                self.write(part, value)
                self._owner[part] = name
                del self.index[part]
            self.index[name] = entry
            return
        path = dat_path(self.folder, name, create=True)
        data = raw_bytes(tensor)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        self._staged[name] = Path(tmp)
        with space_checked(self.folder, path.name, len(data)), os.fdopen(fd, "wb") as f:
            f.write(memoryview(data))
        self.index[name] = {"dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape)}

    def duplicate(self, name: str, source: str) -> None:
        """Make ``name`` hold the same data as the already staged/pointed ``source`` (tied weights)."""
        entry = dict(self.index[source])
        if is_subclass_entry(entry):
            for path, (part, _) in part_files(self.folder, source, entry).items():
                self._link(part_name(name, path), part)
                self._owner[part_name(name, path)] = name
        else:
            self._link(name, source)
        self.index[name] = entry

    def _link(self, name: str, source: str) -> None:
        """Stage ``name``'s file as a hard link to (or a copy of) the staged file of ``source``, if it is staged."""
        if source not in self._staged:
            return
        path = dat_path(self.folder, name, create=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)
        try:
            os.link(self._staged[source], tmp)
        except OSError:
            with space_checked(self.folder, path.name, self._staged[source].stat().st_size):
                self._staged[name] = tmp  # removed by abort() if the copy fails
                shutil.copyfile(self._staged[source], tmp)
        self._staged[name] = tmp

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
        previous = index_to_merge(self.folder)
        replaced = {self._owner.get(name, name) for name in self._staged} & set(previous)
        if replaced:
            write_index({k: v for k, v in previous.items() if k not in replaced}, self.folder)
        for name, tmp in list(self._staged.items()):
            os.replace(tmp, dat_path(self.folder, name))
            del self._staged[name]
        merged = {**previous, **self.index}
        write_index(merged, self.folder)
        warn_replaced(self.folder, previous, self.index)

    def abort(self) -> None:
        """Delete the staged files; the folder's index is left as it was."""
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()
