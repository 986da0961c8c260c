"""A full disk while offloading is named: the folder, the file and its bytes, the bytes free, and the fix.

No real full disk: ``os.fdopen`` (every offload file is written through it) hands out files whose
writes fail with ``ENOSPC`` from a chosen file on, and ``shutil.disk_usage`` reports a fixed free size.
"""

from __future__ import annotations

import collections
import errno
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import disk_offload, load_checkpoint_and_dispatch, offload_state_dict
from bigmodel.offload.storage import OffloadedWeightsLoader, offload_weight

FREE = 12_345


class _FullFile:
    def __init__(self, file) -> None:
        self._file = file

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._file.close()


def _disk_fills_at(monkeypatch: pytest.MonkeyPatch, file_name: str) -> None:
    """Writes fail with ENOSPC from the first file whose final name is ``file_name`` on."""
    real, full = os.fdopen, []

    def fdopen(fd, *args, **kwargs):
        file = real(fd, *args, **kwargs)
        name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))  # .<final name>.<random>.tmp
        full.extend([1] if name.startswith(f".{file_name}.") else [])
        return _FullFile(file) if full else file

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(os, "fdopen", fdopen)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - FREE, FREE))


def _assert_named(info: pytest.ExceptionInfo, folder: Path, file_name: str, size: int) -> None:
    message = str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert f"offload folder {str(folder)!r}" in message, message
    assert f"to write {file_name} ({size:,} bytes; {FREE:,} bytes free there)" in message, message
    assert message.endswith("free some space there or pass another offload_folder."), message


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()} if folder.exists() else {}


def test_offload_state_dict_names_the_full_folder_and_leaves_the_previous_offload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "off"
    offload_state_dict(folder, {"old": torch.ones(2)})
    before = _files(folder)
    _disk_fills_at(monkeypatch, "b.dat")
    with pytest.raises(OSError) as info:
        offload_state_dict(folder, {"a": torch.zeros(3), "b": torch.zeros(5, 2), "c": torch.zeros(1)})
    _assert_named(info, folder, "b.dat", 40)
    monkeypatch.undo()
    assert _files(folder) == before  # no temporary file, no new .dat, the same index
    assert torch.equal(OffloadedWeightsLoader(save_folder=folder)["old"], torch.ones(2))


def test_the_index_write_is_named_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _disk_fills_at(monkeypatch, "index.json")
    with pytest.raises(OSError) as info:
        offload_state_dict(tmp_path, {"a": torch.zeros(3)})
    size = len(b'{\n  "a": {\n    "dtype": "float32",\n    "shape": [\n      3\n    ]\n  }\n}')
    _assert_named(info, tmp_path, "index.json", size)
    assert not (tmp_path / "index.json").exists() and not list(tmp_path.glob(".*.tmp"))


def test_offload_weight_names_the_full_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _disk_fills_at(monkeypatch, "w.dat")
    with pytest.raises(OSError) as info:
        offload_weight(torch.zeros(4, dtype=torch.float16), "w", tmp_path)
    _assert_named(info, tmp_path, "w.dat", 8)
    assert list(tmp_path.iterdir()) == []


def test_disk_offload_names_the_full_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "off"
    _disk_fills_at(monkeypatch, "2.weight.dat")
    with pytest.raises(OSError) as info:
        disk_offload(_net(), folder)
    _assert_named(info, folder, "2.weight.dat", 48)
    assert _files(folder) == {}


def test_load_checkpoint_and_dispatch_names_the_full_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file(_net().state_dict(), tmp_path / "model.safetensors")
    folder = tmp_path / "off"
    _disk_fills_at(monkeypatch, "0.bias.dat")
    with pytest.raises(OSError) as info:
        load_checkpoint_and_dispatch(
            _net(), tmp_path / "model.safetensors", device_map={"0": "disk", "2": "cpu"}, offload_folder=folder,
            dtype=torch.float16,  # written as float16 .dat files, not pointers into the checkpoint
        )
    _assert_named(info, folder, "0.bias.dat", 8)
    assert _files(folder) == {}
