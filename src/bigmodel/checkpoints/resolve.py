"""Which files make up a checkpoint, checked so that none of them is read from outside where it belongs.

A checkpoint is a weights file, a ``.json`` index of a sharded checkpoint (``{"weight_map":
{tensor: shard file}}``, or the plain ``{tensor: shard file}`` mapping), or a folder holding
one index or one weights file.  Shard paths in an index must be relative names that stay
inside the index's folder (no absolute path, no ``..``), and the files they name must resolve
inside it too, symbolic links followed.

The Hugging Face hub cache is the one layout whose files are links leaving their folder:
``models--org--name/snapshots/<revision>/<file>`` links to ``../../blobs/<sha256>``.  In a
folder laid out that way, every file (index, shards, single weights file) may resolve
anywhere inside the repo folder ``models--org--name``, and nowhere else.  Files are returned
under the name of the link (whose suffix tells the format), in the folder's real path.
"""

from __future__ import annotations

import json
import logging
import os
import reprlib
from collections.abc import Mapping
from pathlib import Path

from .hub_hint import HUB_REPO_PREFIX, hub_folder_hint

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
SAFETENSORS_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".index.json"
JSON_SUFFIX = ".json"
WEIGHT_SUFFIXES = (SAFETENSORS_SUFFIX, JSON_SUFFIX, *PICKLE_SUFFIXES)
# The names transformers writes; in a folder with several candidates, one of these wins.
STANDARD_NAMES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)


class CheckpointNotFoundError(FileNotFoundError, ValueError):
    """The checkpoint path does not exist.

    Both a :class:`FileNotFoundError` and a :class:`ValueError`: accelerate raises ``ValueError``
    for a checkpoint path that is neither a file nor a folder, and code written for it catches
    that (``except ValueError``); ``except FileNotFoundError`` / ``OSError`` catch it too.
    """


class CheckpointFiles(list):
    """The weight files of a checkpoint (a list of paths, in reading order), and ``shard_of``: tensor
    name → the shard its index names (empty without an index).  A tensor stored in several shards is
    read from the one the index names (:func:`bigmodel.checkpoints.files.read_tensor_infos`)."""

    def __init__(self, files: list[Path], shard_of: Mapping[str, Path] | None = None) -> None:
        super().__init__(files)
        self.shard_of: dict[str, Path] = dict(shard_of or {})


def resolve_checkpoint_files(checkpoint: str | os.PathLike) -> CheckpointFiles:
    """The weight files of a checkpoint, in reading order.

    Args:
        checkpoint: a ``.safetensors`` file, a ``.bin``/``.pt``/``.pth`` file, a ``.json``
            index of a sharded checkpoint (``*.index.json`` with a ``weight_map``, or a plain
            tensor name → shard file mapping), or a folder holding exactly one index or one
            weights file.  A Hugging Face hub cache snapshot folder
            (``models--org--name/snapshots/<revision>``) is read through its links.

    Returns:
        Absolute paths of the weight files (shards in the order the index first names them),
        each under its own name (a link in a hub snapshot is not replaced by its blob), as a
        :class:`CheckpointFiles` list whose ``shard_of`` maps each tensor an index lists to its shard.

    Raises:
        TypeError: ``checkpoint`` is not a ``str`` or path.
        CheckpointNotFoundError: the checkpoint path is empty or does not exist (a ``FileNotFoundError`` and a
            ``ValueError``, the type accelerate raises there); a dangling or looping link is named as such.
        FileNotFoundError: a shard named by the index does not exist.
        ValueError: unknown file type; a path that is not a regular file (a pipe or device,
            which could block the read forever); a folder with no or several candidates (names them);
            an index entry whose shard path leaves the checkpoint folder (names the entry);
            a file of a hub snapshot linking outside its repo folder (names the file).
    """
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"checkpoint={checkpoint!r} is not a path; pass a weights file, an index or a folder.")
    if not str(checkpoint).strip():  # Path("") is the working directory
        raise CheckpointNotFoundError(
            f"checkpoint={checkpoint!r} is empty; pass a weights file, an index or a folder ('./' for the working "
            "directory)."
        )
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointNotFoundError(f"Checkpoint {str(path)!r} does not exist; {_broken_link_hint(path)}")
    if path.is_dir():
        path = _pick_in_folder(path)
    elif not path.is_file():
        raise ValueError(
            f"Checkpoint {str(path)!r} is not a regular file (a pipe, socket or device); pass a weights file, "
            "an index or a folder."
        )
    repo = hub_repo_folder(path.parent)  # before resolving: a linked repo folder may lie under another name
    path = path.parent.resolve() / path.name
    if path.suffix in (JSON_SUFFIX, SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES) and repo is not None:
        check_hub_link(path, repo)
    if path.suffix == JSON_SUFFIX:
        return _index_shards(path, repo)
    if path.suffix in (SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES):
        return CheckpointFiles([path])
    raise ValueError(
        f"Checkpoint file {str(path)!r} has an unknown type; expected .safetensors, .bin, .pt, .pth or a .json index."
    )


def _broken_link_hint(path: Path) -> str:
    """What to do about a path that does not exist: a dangling or looping link is told apart."""
    if not path.is_symlink():
        return "pass a weights file, an index or a folder."
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"it is a symbolic link to {target!r}, which is missing or loops (in a hub cache: the blob was deleted "
        "or never downloaded); download the file again or pass another checkpoint."
    )


def hub_repo_folder(folder: Path) -> Path | None:
    """The hub repo folder (``models--org--name``, resolved) when ``folder`` is one of its snapshots, else None.

    ``folder`` is looked at as written (made absolute) and resolved: a cache whose repo folder is a link to
    a folder named otherwise (``models--org--name -> /bigdisk/llama``) is a hub repo by the link's name."""
    for path in (Path(os.path.abspath(folder)), folder.resolve()):
        if path.parent.name == "snapshots" and path.parent.parent.name.startswith(HUB_REPO_PREFIX):
            return path.parent.parent.resolve()
    return None


def check_hub_link(path: Path, repo: Path, entry: str | None = None) -> None:
    """Refuse a file of a hub snapshot that resolves outside its repo folder ``repo``.

    Raises:
        ValueError: names the file, where it leads, the repo folder, and the fix.
    """
    target = path.resolve()
    if not target.is_relative_to(repo):
        what = f" (shard of entry {entry!r})" if entry is not None else ""
        raise ValueError(
            f"Checkpoint file {str(path)!r}{what} links to {str(target)!r}, outside the hub repo folder "
            f"{str(repo)!r}; a hub snapshot's files may only link into that folder's blobs/: download the "
            "file again with huggingface_hub."
        )


def _pick_in_folder(folder: Path) -> Path:
    """The one index or weights file of a folder, safetensors first, standard names before others.

    accelerate 1.15 takes ``pytorch_model.bin`` first when a folder holds one: a warning says so
    when bigmodel picks a safetensors checkpoint next to it."""
    entries = sorted(folder.iterdir())
    names = [p.name for p in entries if p.is_file()]
    broken = [p for p in entries if p.is_symlink() and not p.exists() and p.name.endswith(WEIGHT_SUFFIXES)]
    if broken:
        raise FileNotFoundError(f"Checkpoint file {str(broken[0])!r} does not exist; {_broken_link_hint(broken[0])}")
    tiers = [
        [n for n in names if n.endswith(SAFETENSORS_SUFFIX + INDEX_SUFFIX)],
        [n for n in names if n.endswith(SAFETENSORS_SUFFIX)],
        [n for n in names if n.endswith(INDEX_SUFFIX) and not n.endswith(SAFETENSORS_SUFFIX + INDEX_SUFFIX)],
        [n for n in names if n.endswith(PICKLE_SUFFIXES)],
    ]
    for found in tiers:
        standard = [n for n in found if n in STANDARD_NAMES]
        if len(found) == 1 or len(standard) == 1:
            chosen = folder / (found[0] if len(found) == 1 else standard[0])
            _warn_if_accelerate_picks_the_pickle(chosen, names)
            return chosen
        if len(found) > 1:
            raise ValueError(
                f"Checkpoint folder {str(folder)!r} holds several candidate checkpoints: {found}; "
                "pass the file (or *.index.json) to load instead of the folder."
            )
    hint = hub_folder_hint(folder) or "pass the path of the weights file."
    raise ValueError(
        f"Checkpoint folder {str(folder)!r} holds no weights: no *.index.json, .safetensors, .bin, .pt or .pth "
        f"file (found: {names[:20]}); {hint}"
    )


_PICKLE_STANDARD_NAME = "pytorch_model.bin"
_WARNED_FOLDERS: set[Path] = set()


def _warn_if_accelerate_picks_the_pickle(chosen: Path, names: list[str]) -> None:
    """Warn (once per folder) that accelerate loads ``pytorch_model.bin`` from a folder where bigmodel
    chose a safetensors checkpoint: the two files may hold different weights (a stale copy)."""
    if chosen.name == _PICKLE_STANDARD_NAME or _PICKLE_STANDARD_NAME not in names or chosen.parent in _WARNED_FOLDERS:
        return
    _WARNED_FOLDERS.add(chosen.parent)
    logger.warning(
        "Checkpoint folder %r holds both %s and %s; loading %s (safetensors: read lazily, no pickle). "
        "accelerate 1.15 loads %s from such a folder; pass that file's path to load it instead.",
        str(chosen.parent), chosen.name, _PICKLE_STANDARD_NAME, chosen.name, _PICKLE_STANDARD_NAME,
    )


def _read_weight_map(index_path: Path) -> Mapping:
    """The ``weight_map`` of an index, or the index itself when it is a plain name → file mapping."""
    try:
        index = json.loads(index_path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise ValueError(f"Index {str(index_path)!r} is not a sharded-checkpoint index (invalid JSON: {err}).") from err
    if not isinstance(index, Mapping):
        raise ValueError(
            f"Index {str(index_path)!r} is not a sharded-checkpoint index: it holds a {type(index).__name__}, not a "
            "JSON object with a 'weight_map' (or a plain tensor name → shard file object)."
        )
    if "weight_map" not in index:
        odd = next((key for key, value in index.items() if not isinstance(value, str)), None)
        if odd is not None:
            raise ValueError(
                f"Index {str(index_path)!r} has no 'weight_map' and is not a plain tensor name → shard file mapping "
                f"either (entry {odd!r} is {reprlib.repr(index[odd])}, not a shard file name); pass a sharded "
                "checkpoint's index."
            )
        return index
    weight_map = index["weight_map"]
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"Index {str(index_path)!r}: 'weight_map' must map tensor names to shard file names.")
    return weight_map


def _index_shards(index_path: Path, repo: Path | None) -> CheckpointFiles:
    """Validate a sharded checkpoint's index and return its shard files (``repo``: its hub repo folder, if any)."""
    weight_map = _read_weight_map(index_path)
    folder = index_path.parent
    shards: dict[str, Path] = {}
    shard_of: dict[str, Path] = {}
    by_file: dict[Path, Path] = {}  # real path → the path first used for it ("s.bin" and "./s.bin" are one shard)
    for key, shard in weight_map.items():
        if isinstance(shard, str) and shard in shards:
            shard_of[str(key)] = shards[shard]
            continue
        if not isinstance(shard, str):
            raise ValueError(
                f"Index {str(index_path)!r}: entry {key!r} maps to {reprlib.repr(shard)}, not a shard file name; "
                "regenerate the index (or download the checkpoint again)."
            )
        if not _is_relative_name(shard):
            raise ValueError(
                f"Index {str(index_path)!r}: entry {key!r} points to shard {shard!r} outside the checkpoint folder; "
                "shard paths must be file names relative to the index's folder (no '..', no NUL byte)."
            )
        path = folder / shard
        if repo is not None:
            check_hub_link(path, repo, key)
        elif not path.resolve().is_relative_to(folder):
            raise ValueError(
                f"Index {str(index_path)!r}: entry {key!r} points to shard {shard!r}, which resolves outside the "
                f"checkpoint folder ({path.resolve()}); copy the shard into {folder}."
            )
        _check_shard(index_path, key, shard, path)
        path = by_file.setdefault(path.resolve(), path)
        shards[shard] = path
        shard_of[str(key)] = path
    return CheckpointFiles(list(dict.fromkeys(shards.values())), shard_of)


def _check_shard(index_path: Path, key: object, shard: str, path: Path) -> None:
    """Raise unless ``path`` (entry ``key``'s ``shard``) is a weights file.

    Raises:
        FileNotFoundError: the shard is missing.
        ValueError: it is a folder, or not a ``.safetensors`` / ``.bin`` / ``.pt`` / ``.pth`` file.
    """
    where = f"Index {str(index_path)!r}: shard {shard!r} (for {key!r})"
    if path.is_dir():
        raise ValueError(f"{where} is a folder, not a weights file; fix the index (or download the checkpoint again).")
    if not path.is_file():
        raise FileNotFoundError(f"{where} is missing from {path.parent}; download or copy the missing shard.")
    if not path.name.endswith((SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES)):
        raise ValueError(
            f"{where} is not a .safetensors, .bin, .pt or .pth file; fix the index (or download the checkpoint again)."
        )


def _is_relative_name(shard: object) -> bool:
    """True for a non-empty relative path with no ``..`` part and no NUL byte."""
    if not isinstance(shard, str) or not shard or "\0" in shard:
        return False
    return not Path(shard).is_absolute() and ".." not in Path(shard).parts
