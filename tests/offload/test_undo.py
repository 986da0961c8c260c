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


def test_entries_whose_files_were_replaced_go_even_when_the_index_reads_the_same(tmp_path: Path) -> None:
    """Another model of the same names, shapes and dtypes: the index comes out byte-identical, but the
    replaced .dat file no longer holds what the entry described."""
    folder = tmp_path / "off"
    folder.mkdir()
    entries = {"w": {"dtype": "float32", "shape": [1]}, "b": {"dtype": "float32", "shape": [1]}}
    (folder / "index.json").write_text(json.dumps(entries))
    (folder / "w.dat").write_bytes(b"AAAA")
    (folder / "b.dat").write_bytes(b"BBBB")
    with pytest.raises(KeyboardInterrupt), OffloadFolderUndo(folder):
        replacement = folder / ".w.dat.1.tmp"
        replacement.write_bytes(b"ZZZZ")
        replacement.replace(folder / "w.dat")  # as the writer replaces a file
        raise KeyboardInterrupt
    assert json.loads((folder / "index.json").read_text()) == {"b": entries["b"]}


def test_folders_and_links_that_were_there_stay(tmp_path: Path) -> None:
    folder = tmp_path / "off"
    (folder / "empty").mkdir(parents=True)
    (folder / "sub" / "empty").mkdir(parents=True)
    (folder / "dangling.dat").symlink_to(tmp_path / "nowhere")
    with pytest.raises(RuntimeError), OffloadFolderUndo(folder):
        (folder / "w.dat").write_bytes(b"0")
        raise RuntimeError("the load failed")
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == ["dangling.dat", "empty", "sub", "sub/empty"]


def test_parent_folders_the_block_created_go_when_empty(tmp_path: Path) -> None:
    folder = tmp_path / "new" / "deep" / "off"
    with pytest.raises(RuntimeError), OffloadFolderUndo(folder):
        folder.mkdir(parents=True)
        (folder / "w.dat").write_bytes(b"0")
        raise RuntimeError("the load failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == []



USER_INDEX = b'["a user\'s index.json, not an offload index"]\n'


def test_a_users_index_that_nothing_changed_is_not_written_again(tmp_path: Path, monkeypatch) -> None:
    # Before: undo wrote the same bytes back in place, and a write that stopped halfway (a full disk)
    # left the user's file cut.
    import errno

    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "index.json").write_bytes(USER_INDEX)

    def half_then_full(self: Path, data: bytes) -> int:
        with open(self, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half_then_full)
    with pytest.raises(ValueError, match="refused"), OffloadFolderUndo(folder):
        raise ValueError("refused: not an offload index")
    monkeypatch.undo()
    assert (folder / "index.json").read_bytes() == USER_INDEX


def test_a_users_index_the_block_changed_gets_its_bytes_back(tmp_path: Path) -> None:
    folder = tmp_path / "off"
    folder.mkdir()
    (folder / "index.json").write_bytes(USER_INDEX)
    with pytest.raises(RuntimeError), OffloadFolderUndo(folder):
        (folder / "index.json").write_bytes(b"{}")
        raise RuntimeError("the load failed")
    assert (folder / "index.json").read_bytes() == USER_INDEX
    assert sorted(p.name for p in folder.iterdir()) == ["index.json"]  # no temporary file left
