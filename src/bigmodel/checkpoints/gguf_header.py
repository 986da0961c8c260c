"""The fixed start of a GGUF file, read before gguf's reader: is it GGUF at all, and what does it declare.

A GGUF file starts with 24 bytes (llama.cpp's ``docs/gguf.md``): the magic ``b"GGUF"``, a
uint32 version and two uint64 counts, tensors then metadata entries, in the file's byte order
(little-endian; a big-endian file reads as a version whose low 16 bits are zero).  Reading them
first turns a file that is not GGUF (a git-lfs pointer, a safetensors file renamed ``.gguf``, an
HTML error page) into an error saying what the file is, and a file cut short into one saying
where it ends, instead of gguf's "GGUF magic invalid" or numpy's "index 0 is out of bounds".
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
HEADER_BYTES = 24
# What a file that is not GGUF usually is, by its first bytes (checked in this order).
_LOOKALIKES = (
    (b"version https://git-lfs", "a git-lfs pointer, not the file itself: run `git lfs pull` or download the file"),
    (b"PK\x03\x04", "a zip archive, e.g. a torch .bin/.pt checkpoint: pass its model folder instead"),
    (b"\x80", "a Python pickle, e.g. a torch .bin checkpoint: pass its model folder instead"),
    (b"<", "text or HTML, e.g. an error page saved in place of the file: download the file again"),
    (b"{", "JSON, e.g. a config or an index: pass the .gguf file itself"),
)


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file's first 24 bytes declare.

    Attributes:
        version: the format version (gguf's reader handles 2 and 3).
        tensors: number of tensors the header declares.
        entries: number of metadata key/value entries the header declares.
        size: the file's size in bytes.
    """

    version: int
    tensors: int
    entries: int
    size: int


def corrupted_message(path: str | os.PathLike, detail: str) -> str:
    """The one message for a GGUF file that cannot be read as a whole: names the file, the detail and the fix."""
    return f"GGUF file {str(path)!r} is truncated or corrupted ({detail}); download it again."


def read_header(path: str | os.PathLike) -> GGUFHeader:
    """Read and check the first 24 bytes of ``path`` (nothing else is read).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file does not start with ``b"GGUF"`` (names what it starts with and what
            it looks like), or ends inside the 24-byte header (names the byte it ends at).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if not head or head[: len(MAGIC)] != MAGIC[: len(head)]:
        raise ValueError(_not_gguf_message(path, head))
    if len(head) < HEADER_BYTES:
        inside = f"the file ends at byte {size:,}, inside the {HEADER_BYTES}-byte header"
        raise ValueError(corrupted_message(path, inside))
    version, tensors, entries = struct.unpack_from("<IQQ", head, len(MAGIC))
    if version & 0xFFFF == 0:  # written big-endian
        version, tensors, entries = struct.unpack_from(">IQQ", head, len(MAGIC))
    return GGUFHeader(version, tensors, entries, size)


def _not_gguf_message(path: Path, head: bytes) -> str:
    if not head:
        return f"GGUF file {str(path)!r} is empty (0 bytes); download it again."
    if head[8:10] == b'{"':  # an 8-byte header length, then JSON: first, as the length can be any byte
        what: str | None = "a safetensors file: pass its model folder instead"
    else:
        what = next((kind for prefix, kind in _LOOKALIKES if head.startswith(prefix)), None)
    start = f"{str(path)!r} is not a GGUF file: it starts with {head[:12]!r}, not {MAGIC!r}"
    if what is None:
        return f"{start}; pass a file in llama.cpp's GGUF format (or the model folder of another format)."
    return f"{start}; it looks like {what}."
