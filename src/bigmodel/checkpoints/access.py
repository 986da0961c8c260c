"""A weights file that cannot be opened is named with the reason and the fix, never called corrupted.

Readers further down (safetensors' ``safe_open``, ``torch.load``, gguf's memory map) report an
unreadable file in their own words; safetensors says "No such file or directory" for a file
it has no permission to read, and every format wraps the failure as a corrupted file.  Each
reader opens the file here first, so an access problem surfaces as an :class:`OSError` of its
own kind (``errno`` kept) whose message names the file and what to do.
"""

from __future__ import annotations

import os


def check_readable(path: str | os.PathLike, kind: str = "Checkpoint file") -> None:
    """Open ``path`` for reading and close it; raise a named error if that fails.

    Args:
        path: the file.
        kind: how the message calls the file (``"Checkpoint file"``, ``"GGUF file"``).

    Raises:
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a folder.
        PermissionError: the file cannot be read by this user (names the fix: its permissions).
        OSError: any other failure to open it (the system's reason kept).
    """
    try:
        with open(path, "rb"):
            pass
    except PermissionError as error:
        raise _named(error, PermissionError, f"{kind} {str(path)!r} cannot be read (permission denied); "
                     f"fix its permissions (e.g. `chmod u+r {str(path)!r}`) or run as a user who can read it.") from error  # fmt: skip
    except FileNotFoundError as error:
        raise _named(error, FileNotFoundError, f"{kind} {str(path)!r} does not exist (or was removed while "
                     "loading); check the path.") from error  # fmt: skip
    except IsADirectoryError as error:
        raise _named(error, IsADirectoryError, f"{kind} {str(path)!r} is a folder, not a weights file; pass "
                     "the file or use load_checkpoint_in_model with the folder.") from error  # fmt: skip
    except OSError as error:
        raise _named(error, type(error), f"{kind} {str(path)!r} cannot be opened ({error.strerror or error}); "
                     "check the file and its storage.") from error  # fmt: skip


def _named(error: OSError, kind: type[OSError], message: str) -> OSError:
    """An error of ``kind`` with ``error``'s ``errno`` and ``message`` as its text (``[Errno N] message``)."""
    return kind(error.errno, message) if error.errno is not None else kind(message)
