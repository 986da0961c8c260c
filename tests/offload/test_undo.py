"""OffloadFolderUndo: a failed call's offload files go, anything else stays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigmodel.offload.undo import OffloadFolderUndo


def test_only_the_offload_files_the_block_added_are_removed(tmp_path: Path) -> None:
    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "mine.txt").write_text("kept")
    (folder / "old.dat").write_bytes(b"1234")
    (folder / "index.json").write_text(json.dumps({"old": {"dtype": "float32", "shape": [1]}}))
    with pytest.raises(RuntimeError), OffloadFolderUndo(folder):
        (folder / "new.dat").write_bytes(b"5678")
        (folder / "sub").mkdir()
        (folder / "sub" / "w.dat").write_bytes(b"0")
        (folder / ".new.dat.123.tmp").write_bytes(b"0")
        (folder / "notes.txt").write_text("another process's file")  # not an offload file: left alone
        (folder / "index.json").write_text(json.dumps({"old": {"dtype": "float32", "shape": [1]}, "new": {}}))
        raise RuntimeError("the load failed")
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "mine.txt", "notes.txt", "old.dat"]
    assert json.loads((folder / "index.json").read_text()) == {"old": {"dtype": "float32", "shape": [1]}}
    assert (folder / "old.dat").read_bytes() == b"1234"


def test_a_folder_the_block_created_is_removed_and_success_keeps_everything(tmp_path: Path) -> None:
    folder = tmp_path / "off"
    with pytest.raises(RuntimeError), OffloadFolderUndo(folder):
        folder.mkdir()
        (folder / "w.dat").write_bytes(b"0")
        raise RuntimeError("the load failed")
    assert not folder.exists()
    with OffloadFolderUndo(folder):
        folder.mkdir()
        (folder / "w.dat").write_bytes(b"0")
    assert sorted(p.name for p in folder.iterdir()) == ["w.dat"]
