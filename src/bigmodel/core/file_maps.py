"""Weight files mapped into memory only where a rewrite of the file cannot harm the process.

A private memory map of a file stays backed by the file: if the file is truncated or rewritten
in place while tensors view it, reading them raises SIGBUS (the process dies) or returns the new
bytes.  So a file is mapped only when the mapping is *protected*:

- Linux: under a read lease (:mod:`bigmodel.core.leases`).  A writer (this process or another)
  is held back until every mapping of the file has been copied into anonymous memory at the
  same addresses; the model keeps the weights it loaded and the writer then goes on.
- Windows: the OS refuses to truncate, overwrite or replace a file while a mapping of it exists
  (the writer gets a ``PermissionError``), so mappings are protected as they are.
- elsewhere (macOS, BSD), or when Linux refuses the lease (a file of another user without
  ``CAP_LEASE``, a file open for writing, NFS, no free descriptor): tensors are read into
  memory instead (:func:`read_bytes`).

``BIGMODEL_MAPPED_WEIGHTS`` chooses: ``auto`` (the above, default), ``copy`` (never map) or
``map`` (map even unprotected, zero-copy everywhere: a rewrite in place can then kill the process).

Every mapping made here is registered (:func:`is_mapped`), and a file's lease is released when
the last tensor viewing it is freed.  ``import bigmodel`` installs the lease-break handler (on a
free real-time signal) when it runs in the main thread.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import leases
from .subclasses import flatten_tensor, is_tensor_subclass

logger = logging.getLogger(__name__)

POLICY_ENV = "BIGMODEL_MAPPED_WEIGHTS"
POLICIES = ("auto", "copy", "map")


def policy() -> str:
    """The mapping policy from ``BIGMODEL_MAPPED_WEIGHTS`` (``auto`` when unset).

    Raises:
        ValueError: an unknown value (names the variable and the accepted values).
    """
    value = os.environ.get(POLICY_ENV, "auto").strip().lower() or "auto"
    if value not in POLICIES:
        raise ValueError(f"{POLICY_ENV}={value!r} is not one of {list(POLICIES)}; unset it or pick one of them.")
    return value


@dataclass(eq=False)
class MappedFile:
    """One file whose mappings are tracked: its lease (Linux) and how many storages view it.

    Attributes:
        path: the file.
        key: ``(st_dev, st_ino)``.
        lease: the read lease, or None (Windows, or ``map`` policy without a lease).
        holders: live storages mapping the file, plus callers between :func:`hold` and :func:`release`.
        rescued: its mappings were copied into memory because the file was being rewritten.
    """

    path: str
    key: tuple[int, int]
    lease: leases.Lease | None
    holders: int = 1
    rescued: bool = False


class _Serial:
    """A lock that neither a signal handler nor a finalizer running inside its holder can deadlock.

    A call made by the thread that is already running one (the main thread interrupted by the
    lease signal, or a garbage-collection finalizer) is queued and run before the outer call returns.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entered only by the thread holding it
        self._depth = 0
        self._queue: list[tuple[Callable, tuple]] = []

    def run(self, function: Callable, *args: object) -> object:
        with self._lock:
            if self._depth:
                self._queue.append((function, args))
                return None
            self._depth = 1
            try:
                result = function(*args)
                while self._queue:
                    queued, queued_args = self._queue.pop(0)
                    queued(*queued_args)
            finally:
                self._depth = 0
        return result


_serial = _Serial()
_files: dict[tuple[int, int], MappedFile] = {}
_storages: dict[int, MappedFile] = {}  # data_ptr of a mapped storage → its file
_told: set[str] = set()


def _protected_by_os() -> bool:
    return os.name == "nt"


@functools.lru_cache(maxsize=1)
def _lease_budget() -> int:
    """How many files may hold a lease (each keeps one descriptor open): half the soft limit."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(16, soft // 2)


def _unprotected(path: Path, reason: str) -> None:
    level = logging.DEBUG if reason in _told else logging.INFO
    _told.add(reason)
    logger.log(level, "Reading %s into memory instead of mapping it: %s.", path, reason)


def _new_entry(path: Path, key: tuple[int, int], mode: str) -> MappedFile | None:
    if _protected_by_os():
        return MappedFile(str(path), key, None)
    if not leases.supported():
        reason = "this OS has no file leases to protect a mapping"
        lease = None
    elif not leases.install_handler():
        reason = "bigmodel was first used outside the main thread, which alone can take lease signals"
        lease = None
    elif leases.held() >= _lease_budget():
        reason = "too many mapped files for the descriptor limit (raise `ulimit -n`)"
        lease = None
    else:
        lease, reason = leases.take_lease(str(path))
    if lease is not None and (lease.dev, lease.ino) != key:
        lease.release()  # replaced between stat and open
        lease, reason = None, "it was replaced while being opened"
    if lease is None and mode != "map":
        _unprotected(path, reason)
        return None
    return MappedFile(str(path), key, lease)


def hold(path: str | os.PathLike) -> MappedFile | None:
    """Start mapping ``path``: its tracked entry (a lease taken if needed), or None to read it instead.

    Call :func:`attach` for each storage mapping the file, then :func:`release` once.

    Args:
        path: the file about to be mapped.

    Returns:
        The file's entry (held until :func:`release`), or None when the file must not be mapped
        (``copy`` policy, or no protection under ``auto``; the reason is logged at INFO once).

    Raises:
        ValueError: ``BIGMODEL_MAPPED_WEIGHTS`` holds an unknown value.
        FileNotFoundError: ``path`` does not exist.
    """
    mode = policy()
    if mode == "copy":
        return None
    path = Path(path)
    st = path.stat()
    key = (st.st_dev, st.st_ino)

    def find() -> MappedFile | None:
        entry = _files.get(key)
        if entry is not None and not entry.rescued:
            leased = entry.lease is not None and entry.lease.fd >= 0
            if leased or (entry.lease is None and (mode == "map" or _protected_by_os())):
                entry.holders += 1
                return entry
        entry = _new_entry(path, key, mode)
        if entry is not None:
            _files[key] = entry
        return entry

    return _serial.run(find)  # type: ignore[return-value]


def attach(entry: MappedFile, storage: torch.UntypedStorage) -> None:
    """Track ``storage`` (a mapping of ``entry``'s file) until it is freed.

    Args:
        entry: from :func:`hold`.
        storage: a storage whose memory maps that file; it keeps the file's lease while it lives.
    """
    pointer = storage.data_ptr()

    def add() -> None:
        entry.holders += 1
        _storages[pointer] = entry

    _serial.run(add)
    weakref.finalize(storage, _freed, entry, pointer)


def _freed(entry: MappedFile, pointer: int) -> None:
    def drop() -> None:
        if _storages.get(pointer) is entry:
            del _storages[pointer]
        _drop(entry)

    _serial.run(drop)


def release(entry: MappedFile) -> None:
    """End the :func:`hold` of ``entry`` (its attached storages keep it alive)."""
    _serial.run(_drop, entry)


def _drop(entry: MappedFile) -> None:
    entry.holders -= 1
    if entry.holders > 0:
        return
    if entry.lease is not None:
        entry.lease.release()
    if _files.get(entry.key) is entry:
        del _files[entry.key]


def is_mapped(tensor: torch.Tensor) -> bool:
    """``tensor`` views a file mapping made here (so it costs no anonymous memory until written).

    Args:
        tensor: any tensor.

    Returns:
        True for a CPU tensor whose storage is one :func:`map_file` or a mapped pickle registered
        with :func:`attach` made (also after a rewrite of the file copied it into memory).  A
        wrapper tensor subclass (torchao's quantized weights) holds no storage of its own: True
        when any of its inner tensors is such a view.
    """
    if is_tensor_subclass(tensor):
        return any(is_mapped(part) for part in flatten_tensor(tensor)[0].values())
    return tensor.device.type == "cpu" and tensor.untyped_storage().data_ptr() in _storages


def map_file(path: str | os.PathLike, nbytes: int) -> torch.UntypedStorage | None:
    """The first ``nbytes`` of ``path`` as a private, protected mapping; None when it must be read instead.

    Args:
        path: the file.
        nbytes: bytes to map from its start (at most its size).

    Returns:
        A storage of ``nbytes`` bytes viewing the file (writes stay private to this process), or
        None: read the file with :func:`read_bytes` instead.

    Raises:
        ValueError: the file is shorter than ``nbytes`` or was replaced while being mapped (names it);
            an unknown ``BIGMODEL_MAPPED_WEIGHTS``.
    """
    entry = hold(path)
    if entry is None:
        return None
    try:
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=nbytes)
        st = os.stat(path)
        if (st.st_dev, st.st_ino) != entry.key or st.st_size < nbytes:
            raise ValueError(
                f"{str(path)!r} changed while it was being mapped ({st.st_size} bytes, {nbytes} expected); "
                "load it again once it is complete."
            )
        if entry.rescued:  # rewritten meanwhile: this mapping may be of the new, partial content
            return None
        attach(entry, storage)
        return storage
    finally:
        release(entry)


def read_bytes(
    path: str | os.PathLike, offset: int, nbytes: int, check: Callable[[os.stat_result], None] | None = None
) -> torch.Tensor:
    """``nbytes`` of ``path`` from ``offset`` read into a new ``uint8`` CPU tensor (safe from any thread).

    Args:
        path: the file.
        offset: where to start, in bytes from the file's start.
        nbytes: how many bytes to read.
        check: called with the opened file's ``os.fstat`` before reading (to refuse a file that
            changed since its header was read); it raises to refuse.

    Returns:
        A new 1-D ``torch.uint8`` tensor of ``nbytes`` elements.

    Raises:
        ValueError: the file ends before ``offset + nbytes`` (names the file).
    """
    out = torch.empty(nbytes, dtype=torch.uint8)
    view = memoryview(out.numpy()) if nbytes else memoryview(b"")
    with open(path, "rb") as f:
        if check is not None:
            check(os.fstat(f.fileno()))
        f.seek(offset)
        done = 0
        while done < nbytes:
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(
                    f"{str(path)!r} ends at byte {offset + done}, before the {nbytes} bytes expected at offset "
                    f"{offset}: it was truncated or is being rewritten; load it again once it is complete."
                )
            done += got
    return out


def _on_break() -> None:
    """Lease-break signal (main thread): copy the mappings of every file being rewritten, release it."""
    _serial.run(_rescue_breaking)


def _rescue_breaking() -> None:
    lost: list[str] = []
    for entry in list(_files.values()):
        if entry.lease is None or not entry.lease.breaking():
            continue
        try:
            copied, missing = leases.copy_mappings_to_memory(entry.lease)
        except OSError as err:
            logger.error("Could not copy the mappings of %s into memory (%s).", entry.path, err)
            copied, missing = 0, 1
        entry.rescued = True
        entry.lease.release()
        if _files.get(entry.key) is entry:
            del _files[entry.key]
        if missing:
            lost.append(entry.path)
        else:
            logger.warning(
                "%s is being rewritten while loaded weights map it: copied them into memory (%s bytes); the "
                "model keeps the weights it loaded. (A writer interrupted by this, e.g. torch.save failing "
                "with 'Interrupted system call', can simply be run again.)", entry.path, f"{copied:,}",
            )  # fmt: skip
    if lost:
        raise RuntimeError(
            f"{lost} were truncated before the weights mapping them could be copied into memory, so some "
            "weights now read as zeros; load the model again from a complete checkpoint."
        )


leases.set_callback(_on_break)
leases.install_handler()  # normally done by ``import bigmodel`` already
