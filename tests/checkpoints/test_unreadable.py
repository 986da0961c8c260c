"""A weights file this user cannot read is named with the fix (its permissions), never called corrupted."""

from __future__ import annotations

import builtins
import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import load_checkpoint_in_model, load_state_dict
from bigmodel.checkpoints import files
from bigmodel.checkpoints.files import read_tensor_infos


def _make_unreadable(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mode 0; as root (who reads it anyway) every open of ``path`` fails the way it does for a user."""
    path.chmod(0)
    if os.geteuid() != 0:
        return
    real_open, real_safe_open = builtins.open, files.safe_open

    def denied(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    def safe_open(file, *args, **kwargs):  # safetensors' own words for it, as a non-root user sees them
        if str(file) == str(path):
            raise Exception(f"No such file or directory: {file}")
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)
    monkeypatch.setattr(files, "safe_open", safe_open)


def _assert_permission_error(info: pytest.ExceptionInfo, path: Path) -> None:
    message = str(info.value)
    assert info.value.errno == errno.EACCES
    assert repr(str(path)) in message and "permission denied" in message and "fix its permissions" in message, message
    assert "corrupted" not in message and "No such file" not in message, message


@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_load_state_dict_names_an_unreadable_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    path = tmp_path / name
    tensors = {"weight": torch.arange(6.0).reshape(2, 3)}
    save_file(tensors, path) if name.endswith(".safetensors") else torch.save(tensors, path)
    before = path.read_bytes()
    _make_unreadable(path, monkeypatch)
    with pytest.raises(PermissionError) as info:
        load_state_dict(path)
    _assert_permission_error(info, path)
    monkeypatch.undo()
    assert stat.S_IMODE(path.stat().st_mode) == 0  # the user's file is left as it was
    path.chmod(0o644)
    assert path.read_bytes() == before
    assert torch.equal(load_state_dict(path)["weight"], tensors["weight"])


def test_an_unreadable_shard_is_named_before_anything_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(3, 2)
    save_file({"weight": torch.ones(2, 3), "bias": torch.full((2,), 7.0)}, tmp_path / "model.safetensors")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _make_unreadable(tmp_path / "model.safetensors", monkeypatch)
    with pytest.raises(PermissionError) as info:
        load_checkpoint_in_model(model, tmp_path)
    _assert_permission_error(info, tmp_path / "model.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_missing_file_is_not_called_corrupted(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"gone\.safetensors' does not exist .*; check the path"):
        read_tensor_infos([tmp_path / "gone.safetensors"])


def test_an_unreadable_gguf_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("gguf")
    from _gguf_files import tiny_llama, write_tiny_gguf

    from bigmodel.checkpoints.gguf import open_reader

    path = write_tiny_gguf(tmp_path / "model.gguf", tiny_llama(layers=1))
    _make_unreadable(path, monkeypatch)
    with pytest.raises(PermissionError) as info:
        open_reader(path)
    _assert_permission_error(info, path)
