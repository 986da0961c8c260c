"""Rank 0's side of broadcast loading: a checkpoint's tensors as raw bytes, one at a time."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..checkpoints.files import (
    TensorInfo,
    load_torch_file,
    read_header,
    read_tensor_infos,
    resolve_checkpoint_files,
)


class RankZeroReader:
    """Reads a checkpoint's tensors by name as flat ``uint8`` CPU buffers, one at a time (rank 0 only).

    Files are resolved and validated by :mod:`bigmodel.checkpoints.files`.  Safetensors data is
    read with ``readinto`` at the offsets of the file's header rather than through a
    memory map, so the process holds one tensor at a time instead of the file's pages;
    torch pickles come from :func:`bigmodel.checkpoints.files.load_torch_file` (memory-mapped zip files).

    Args:
        checkpoint: a weights file, a ``*.index.json`` or a folder.

    Raises:
        FileNotFoundError / ValueError: from :func:`bigmodel.checkpoints.files.resolve_checkpoint_files`.
    """

    def __init__(self, checkpoint: str | os.PathLike) -> None:
        self._pickles: dict[Path, dict[str, torch.Tensor]] = {}
        self.infos: dict[str, TensorInfo] = read_tensor_infos(resolve_checkpoint_files(checkpoint), self._pickles)
        self._headers: dict[Path, tuple[dict[str, dict], int]] = {}

    def manifest(self) -> list[tuple[str, tuple[int, ...], torch.dtype, int]]:
        """``(name, shape, dtype, bytes)`` of every tensor, in file order."""
        return [(i.name, i.shape, i.dtype, math.prod(i.shape) * i.dtype.itemsize) for i in self.infos.values()]

    def read_bytes(self, name: str) -> torch.Tensor:
        """The raw bytes of tensor ``name`` (C order) as a 1-D ``uint8`` CPU tensor.

        Raises:
            ValueError: the file is shorter than its header says (names the file and tensor).
        """
        info = self.infos[name]
        if not info.is_safetensors:
            return self._pickled(info).contiguous().reshape(-1).view(torch.uint8)
        if info.file not in self._headers:
            self._headers = {info.file: read_header(info.file)}  # files are read in order: keep one header
        entries, data_start = self._headers[info.file]
        start, end = entries[name]["data_offsets"]
        buf = torch.empty(end - start, dtype=torch.uint8)
        view = memoryview(buf.numpy())
        with open(info.file, "rb") as handle:
            handle.seek(data_start + start)
            done = 0
            while done < end - start:
                got = handle.readinto(view[done:])
                if not got:
                    raise ValueError(f"{info.file} is truncated at tensor {name!r}; download or save it again.")
                done += got
        return buf

    def _pickled(self, info: TensorInfo) -> torch.Tensor:
        if info.file not in self._pickles:
            self._pickles = {info.file: load_torch_file(info.file)}  # non-zip pickles: one file in RAM at a time
        return self._pickles[info.file][info.name]

    def close(self) -> None:
        self._pickles.clear()
        self._headers.clear()
