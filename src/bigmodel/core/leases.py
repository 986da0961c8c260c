"""Linux read leases on mapped weight files, and moving a file's mappings into memory when it is rewritten.

A read lease (``fcntl(fd, F_SETLEASE, F_RDLCK)`` on a read-only descriptor) makes the kernel
hold back every ``open`` for writing and every ``truncate`` of the file, by this process or
any other, for up to ``/proc/sys/fs/lease-break-time`` seconds (45 by default), and send this
process a signal.  The handler runs in the main thread: it copies every private mapping of the
file into anonymous memory *at the same addresses* (``mremap`` of a filled anonymous region over
the file's pages, one atomic system call per mapping), so every tensor viewing the file keeps
its pointer and its values; then it releases the lease and the writer goes on.

Leases need the file's owner or ``CAP_LEASE`` (root has it); the signal goes to the main thread
(``F_SETOWN_EX``) because only the main thread runs Python signal handlers.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import signal
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

F_SETOWN_EX = 15  # <linux/fcntl.h>; Python's fcntl module does not export it
F_OWNER_TID = 0
_PROT = {"r": 0x1, "w": 0x2, "x": 0x4}
_MAP_PRIVATE_ANONYMOUS = 0x02 | 0x20
_MREMAP_MAYMOVE_FIXED = 0x1 | 0x2
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_state: dict[str, object] = {"signal": None, "callback": None}
_held = [0]  # leases held by this process


def held() -> int:
    """How many leases (so descriptors) this process holds."""
    return _held[0]


class _Libc:
    """``mmap``/``mremap``/``mprotect``/``munmap`` from the C library (Linux)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        vp, size, i, off = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_long
        self.mmap = self._bind(libc.mmap, vp, [vp, size, i, i, i, off])
        self.mremap = self._bind(libc.mremap, vp, [vp, size, size, i, vp])
        self.mprotect = self._bind(libc.mprotect, i, [vp, size, i])
        self.munmap = self._bind(libc.munmap, i, [vp, size])
        self.failed = ctypes.c_void_p(-1).value

    @staticmethod
    def _bind(function: Callable, restype: object, argtypes: list) -> Callable:
        function.restype = restype
        function.argtypes = argtypes
        return function

    def check(self, result: int | None, what: str) -> int:
        if result is None or result == self.failed:
            code = ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")
        return result


_libc: _Libc | None = None


def supported() -> bool:
    """Leases exist here (Linux with ``F_SETLEASE``)."""
    return os.name == "posix" and hasattr(fcntl, "F_SETLEASE") and os.uname().sysname == "Linux"


def set_callback(callback: Callable[[], None]) -> None:
    """What the lease-break handler runs (in the main thread, on every lease-break signal)."""
    _state["callback"] = callback


def install_handler() -> bool:
    """Install the lease-break handler (once; only the main thread can).  True when it is installed.

    A real-time signal whose handler is still the default is chosen, so no handler of the
    application is replaced.  ``import bigmodel`` calls this, so that models loaded later by
    any thread can take leases.
    """
    if _state["signal"] is not None:
        return True
    if not supported() or threading.current_thread() is not threading.main_thread():
        return False
    for signum in range(signal.SIGRTMAX - 2, signal.SIGRTMIN + 3, -1):
        if signal.getsignal(signum) == signal.SIG_DFL:
            break
    else:
        logger.info("No free real-time signal for file leases: weights will be read instead of mapped.")
        return False
    signal.signal(signum, _on_signal)
    _state["signal"] = signum
    return True


def _on_signal(signum: int, frame: object) -> None:
    callback = _state["callback"]
    if callback is not None:
        callback()  # type: ignore[operator]


@dataclass
class Lease:
    """A read lease on one file, held through a read-only descriptor.

    Attributes:
        fd: the descriptor holding the lease (-1 once released).
        dev, ino: the file's identity (``st_dev``, ``st_ino``).
        size: the file's size in bytes when the lease was taken.
        path: the path it was opened by.
    """

    fd: int
    dev: int
    ino: int
    size: int
    path: str

    def breaking(self) -> bool:
        """A writer is waiting (or the kernel has already given up the lease)."""
        if self.fd < 0:
            return False
        try:
            return fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True

    def release(self) -> None:
        """Give the lease up and close the descriptor (idempotent)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        _held[0] -= 1
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        except OSError:
            pass
        os.close(fd)


def take_lease(path: str) -> tuple[Lease | None, str]:
    """A read lease on ``path``, or ``(None, reason)`` when the kernel refuses it.

    Refusals: ``EACCES``/``EPERM`` (the file belongs to another user and the process lacks
    ``CAP_LEASE``), ``EAGAIN`` (the file is open for writing somewhere), ``EINVAL``/``ENOSYS``
    (the file system has no leases, e.g. NFS), ``EMFILE`` (no descriptor left).
    """
    signum = _state["signal"]
    if signum is None:
        return None, "no lease-break handler (bigmodel was first used outside the main thread)"
    if signal.getsignal(signum) is not _on_signal:  # a lease signal without its handler would kill the process
        return None, f"the application replaced bigmodel's handler of signal {signum}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        return None, f"cannot open it ({err.strerror})"
    try:
        fcntl.fcntl(fd, fcntl.F_SETSIG, signum)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        fcntl.fcntl(fd, F_SETOWN_EX, struct.pack("ii", F_OWNER_TID, threading.main_thread().native_id))
        st = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        reason = {errno.EACCES: "it belongs to another user", errno.EPERM: "it belongs to another user",
                  errno.EAGAIN: "it is open for writing"}.get(err.errno, err.strerror)  # fmt: skip
        return None, f"no lease ({reason})"
    _held[0] += 1
    return Lease(fd, st.st_dev, st.st_ino, st.st_size, path), ""


def _mappings_of(lease: Lease) -> list[tuple[int, int, str, int]]:
    """``(start, end, perms, file offset)`` of every private mapping of the leased file in this process."""
    found = []
    dev = f"{os.major(lease.dev):02x}:{os.minor(lease.dev):02x}"
    real = os.path.realpath(lease.path)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 5 or int(parts[4]) != lease.ino or parts[1][3] != "p":
                continue
            name = parts[5].strip() if len(parts) > 5 else ""
            if parts[3] != dev and name != real:  # overlay file systems show the lower device
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            found.append((start, end, parts[1], int(parts[2], 16)))
    return found


def copy_mappings_to_memory(lease: Lease) -> tuple[int, int]:
    """Replace every private mapping of the leased file by an anonymous copy at the same address.

    Returns:
        ``(bytes copied, bytes lost)``: lost bytes were past the file's current end (the file was
        truncated before the copy: the kernel had given up the lease); they read as zeros.
    """
    global _libc
    _libc = _libc or _Libc()
    size = os.fstat(lease.fd).st_size if lease.fd >= 0 else os.stat(lease.path).st_size
    copied = lost = 0
    for start, end, perms, offset in _mappings_of(lease):
        length = end - start
        valid = max(0, min(length, size - offset))
        anon = _libc.check(_libc.mmap(None, length, 0x1 | 0x2, _MAP_PRIVATE_ANONYMOUS, -1, 0), "mmap")
        try:
            ctypes.memmove(anon, start, valid)
            prot = sum(_PROT[c] for c in perms[:3] if c in _PROT)
            if prot != 0x1 | 0x2 and _libc.mprotect(anon, length, prot) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed")
            _libc.check(_libc.mremap(anon, length, length, _MREMAP_MAYMOVE_FIXED, start), "mremap")
        except BaseException:
            _libc.munmap(anon, length)
            raise
        copied += valid
        lost += length - min(length, -(-valid // _PAGE) * _PAGE)
    return copied, lost
