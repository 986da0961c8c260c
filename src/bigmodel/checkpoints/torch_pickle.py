"""Torch pickle checkpoints (``.bin``/``.pt``/``.pth``): ``torch.load(weights_only=True)``, memory-mapped when zipped.

The map is taken only where it is protected (:func:`bigmodel.core.file_maps.hold`): a file being
rewritten while its tensors are read is then copied into memory first instead of killing the process.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from ..core.file_maps import attach, hold, release
from ..core.subclasses import flatten_tensor, is_tensor_subclass
from .access import check_readable

logger = logging.getLogger(__name__)

_NOTED: set[tuple] = set()  # (file, its mtime and size, key) already noted: a file is read up to 3 times a load


def load_torch_file(path: str | os.PathLike, mmap: bool | None = None) -> dict[str, torch.Tensor]:
    """Load a torch pickle with ``weights_only=True``.

    Args:
        path: the file.
        mmap: ``False`` reads every tensor into memory; ``None`` maps a zip file where the
            mapping is protected (:func:`bigmodel.core.file_maps.hold`) and reads it otherwise.

    Raises:
        PermissionError / FileNotFoundError / OSError: the file cannot be opened (names it and the fix).
        pickle.UnpicklingError: the pickle would need to run code (names the file and the fix).
        ValueError: the file is corrupted or not a torch checkpoint of tensors.
    """
    path = Path(path)
    check_readable(path)  # torch.load's OSError would otherwise be reported as a corrupted file
    guard = hold(path) if mmap is not False and zipfile.is_zipfile(path) else None
    try:
        tensors = _load(path, mmap=guard is not None)
        if guard is not None:
            plain = [p for t in tensors.values() for p in _plain_parts(t)]
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in plain if t.numel()}
            for storage in storages.values():
                attach(guard, storage)
    finally:
        if guard is not None:
            release(guard)
    return tensors


def _plain_parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor``, or the inner tensors of a wrapper subclass (torchao's quantized weights), which hold its storage."""
    return list(flatten_tensor(tensor)[0].values()) if is_tensor_subclass(tensor) else [tensor]


def _load(path: Path, mmap: bool) -> dict[str, torch.Tensor]:
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        # torch words it "Unsupported global: GLOBAL x.y" or "unsupported GLOBAL x.y whose module x is blocked".
        found = re.search(r"GLOBAL \S+", str(err))
        if found is None:
            reason = re.search(r"WeightsUnpickler error:\s*(.+)", str(err))
            raise ValueError(
                f"Checkpoint file {str(path)!r} is not a readable torch checkpoint "
                f"({reason.group(1) if reason else 'unpickling failed'}); it may be corrupted: save it again."
            ) from err
        raise pickle.UnpicklingError(
            f"Refusing to load {str(path)!r}: it is not a plain tensor pickle and unpickling it could run code "
            f"({found.group(0)}). Convert it to .safetensors from a trusted source."
        ) from err
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, IndexError, struct.error) as err:
        # Garbage that is neither a zip nor a pickle fails deep inside torch.load (e.g. KeyError).
        reason = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        raise ValueError(
            f"Checkpoint file {str(path)!r} is not a readable torch checkpoint ({reason}); save it again."
        ) from err
    if not isinstance(loaded, Mapping):
        raise ValueError(f"Checkpoint file {str(path)!r} holds a {type(loaded).__name__}, not a state dict of tensors.")
    tensors = {}
    for name, value in loaded.items():
        if isinstance(name, str) and isinstance(value, torch.Tensor):
            tensors[name] = value
        else:
            _note_skipped(path, name, value)
    return tensors


def _note_skipped(path: Path, name: object, value: object) -> None:
    """Log once per file version what an entry that is not a tensor is, and for a nested state dict the fix."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, repr(name))
    if key in _NOTED:
        return
    if len(_NOTED) > 10_000:
        _NOTED.clear()
    _NOTED.add(key)
    if not isinstance(name, str):
        logger.warning("%s: skipping key %r, which is a %s and not a tensor name.", path, name, type(name).__name__)
        return
    nested = [k for k, v in value.items() if isinstance(v, torch.Tensor)] if isinstance(value, Mapping) else []
    if nested:
        logger.warning(
            "%s holds a nested state dict under %r (%d tensors, e.g. %r), not tensors at its top level; its tensors "
            "are not loaded. Save the nested state dict itself: ckpt = torch.load(path); "
            "torch.save(ckpt[%r], path).", path, name, len(nested), nested[0], name,
        )  # fmt: skip
    else:
        logger.warning("%s: skipping %r, which is a %s and not a tensor.", path, name, type(value).__name__)
