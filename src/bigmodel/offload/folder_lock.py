"""One writer per offload folder at a time: an exclusive lock held while a call writes a folder and maps its files.

Two processes (or threads) offloading into the same folder at once would interleave their
``.dat`` renames and ``index.json`` rewrites, and a model could end up mapping the other
model's files (wrong values, no error).  :func:`folder_lock` serialises them: a second call
waits until the first has written the folder and mapped what it needs (an INFO log says it
waits), then runs on a folder in a consistent state.

The lock is an ``flock`` on a file named after the folder's real path in a private folder of
the temporary directory (``bigmodel-locks-<uid>``), so nothing is added to the offload folder
and a folder that does not exist yet can be locked.  It is re-entrant within a thread
(``load_checkpoint_and_dispatch`` locks, then calls the loader and ``dispatch_model``, which
lock too).  Where ``fcntl`` is missing (Windows) only threads of one process are serialised.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

_registry_lock = threading.Lock()
_held: dict[str, list] = {}  # real path → [RLock, depth, lock-file descriptor or None]


def lock_file_for(folder: str | os.PathLike) -> Path:
    """The lock file of ``folder`` (named after a hash of its real path; never inside the folder)."""
    key = os.path.realpath(os.fspath(folder))
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    name = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return Path(tempfile.gettempdir()) / f"bigmodel-locks-{uid}" / f"{name}.lock"


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike | None) -> Iterator[None]:
    """Hold the exclusive lock of offload folder ``folder`` for the block (None: no lock).

    Blocks while another process or thread holds it; re-entrant in the thread holding it.  Where
    the lock file cannot be made (an unwritable temporary directory), a warning says so and the
    block runs unlocked.
    """
    if folder is None:
        yield
        return
    key = os.path.realpath(os.fspath(folder))
    with _registry_lock:
        held = _held.setdefault(key, [threading.RLock(), 0, None])
    with held[0]:
        if held[1] == 0:
            held[2] = _acquire(folder)
        held[1] += 1
        try:
            yield
        finally:
            held[1] -= 1
            if held[1] == 0 and held[2] is not None:
                os.close(held[2])  # releases the flock
                held[2] = None


def _acquire(folder: str | os.PathLike) -> int | None:
    if fcntl is None:  # pragma: no cover - Windows
        return None
    path = lock_file_for(folder)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        if hasattr(os, "getuid") and path.parent.stat().st_uid != os.getuid():
            raise PermissionError(f"{str(path.parent)!r} belongs to another user")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        logger.warning("Cannot lock offload folder %s (%s); another process offloading into it at the same "
                       "time could mix its files with this call's.", folder, err)  # fmt: skip
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Offload folder %s is being written by another process; waiting until it is done.", folder)
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd
