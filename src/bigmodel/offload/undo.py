"""Undo what a failed call added to an offload folder, never touching what was there before."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from types import TracebackType

from .format import INDEX_NAME, dat_path, entry_files, folder_path
from .writer import atomic_write, write_index

logger = logging.getLogger(__name__)


def _offload_file(name: str) -> bool:
    """True for the kinds of file an offload writes: ``.dat`` files, ``index.json``, and the writer's
    temporary files (``.<name>.*.tmp``, ``.bigmodel-probe-*``)."""
    return (name.endswith(".dat") or name == INDEX_NAME or (name.startswith(".") and name.endswith(".tmp"))
            or name.startswith(".bigmodel-probe-"))


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_ino, stat.st_mtime_ns


class OffloadFolderUndo:
    """Context manager: when its block raises, remove what the block added to ``folder``.

    Files an offload writes (``.dat``, ``index.json``, its temporary files) and emptied subfolders that
    were not there on entry are deleted (the whole folder when the block created it; any other file
    added meanwhile, e.g. by another process in a shared folder, is left), and ``index.json`` gets its previous content back, less the entries whose
    files the block replaced (so no entry describes a file holding other bytes).  Files that were
    there before are never deleted.  Nothing happens when the block succeeds.

    Args:
        folder: the offload folder (None: nothing to watch).
    """

    def __init__(self, folder: str | os.PathLike | None) -> None:
        self.folder = folder_path(folder) if folder is not None else None
        self._existed = False
        self._present: set[str] = set()  # every path inside the folder on entry (folders and links too)
        self._before: dict[str, tuple[int, int]] = {}  # the regular files among them: their identity
        self._index: bytes | None = None
        self._created_parents: list[Path] = []  # missing ancestors on entry, innermost first

    def __enter__(self) -> OffloadFolderUndo:
        folder = self.folder
        self._existed = folder is not None and folder.is_dir()
        if self._existed:
            paths = {str(p.relative_to(folder)): p for p in folder.rglob("*")}
            self._present = set(paths)
            self._before = {key: _identity(p) for key, p in paths.items() if p.is_file() and not p.is_symlink()}
            index = folder / INDEX_NAME
            self._index = index.read_bytes() if index.is_file() else None
        elif folder is not None:
            parent = folder.absolute().parent
            while not parent.exists() and parent != parent.parent:
                self._created_parents.append(parent)
                parent = parent.parent
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None or self.folder is None or not self.folder.is_dir():
            return
        try:
            self._undo(self.folder)
        except OSError as err:  # the original error matters more; say what is left
            logger.warning("Could not remove what the failed call wrote into %s: %s", self.folder, err)

    def _undo(self, folder: Path) -> None:
        if not self._existed:
            shutil.rmtree(folder)
            for parent in self._created_parents:  # made by mkdir(parents=True): removed while empty
                try:
                    parent.rmdir()
                except OSError:
                    break
            return
        added = sorted((p for p in folder.rglob("*") if str(p.relative_to(folder)) not in self._present),
                       key=lambda p: len(p.parts), reverse=True)  # deepest first  # fmt: skip
        for path in added:
            if path.is_dir() and not path.is_symlink():
                try:
                    path.rmdir()  # only when emptied: a subfolder of tensor names ("a/b.dat")
                except OSError:
                    pass
            elif _offload_file(path.name):  # never a file of another kind (another process's, in a shared folder)
                path.unlink(missing_ok=True)
        if self._index is not None:
            self._restore_index(folder)

    def _restore_index(self, folder: Path) -> None:
        index = folder / INDEX_NAME
        try:
            previous = json.loads(self._index or b"{}")
        except ValueError:
            previous = None
        if not isinstance(previous, dict):  # not an index bigmodel can read: its bytes as they were
            if not index.is_file() or index.read_bytes() != self._index:  # never rewritten in place: a failed
                atomic_write(index, lambda f: f.write(self._index or b""))  # write would cut the user's file
            return
        kept = {name: entry for name, entry in previous.items() if not self._replaced(folder, name, entry)}
        if kept == previous and index.is_file() and index.read_bytes() == self._index:
            return  # untouched, and no file it describes was replaced
        write_index(kept, folder)  # also when the bytes came out the same: replaced files lose their entries

    def _replaced(self, folder: Path, name: str, entry: object) -> bool:
        for file_name in entry_files(name, entry):
            path = dat_path(folder, file_name)
            key = str(path.relative_to(folder))
            if key in self._before and (not path.is_file() or _identity(path) != self._before[key]):
                return True
        return False
