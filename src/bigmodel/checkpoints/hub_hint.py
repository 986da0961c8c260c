"""What to pass instead of a Hugging Face hub cache folder that is not a snapshot.

``huggingface_hub`` keeps a repo as ``models--org--name/`` with ``blobs/``, ``refs/<branch>``
(a file holding a revision hash) and ``snapshots/<revision>/`` (the files, as links into
``blobs/``).  Only a snapshot folder holds the checkpoint's files under their names; the repo
folder, its ``snapshots/`` folder and the cache folder above hold none, so a loader pointed at
them finds no weights.  :func:`hub_folder_hint` says which snapshot folder to pass.
"""

from __future__ import annotations

from pathlib import Path

HUB_REPO_PREFIX = "models--"
_SHOWN = 5


def hub_folder_hint(folder: Path) -> str | None:
    """The fix for a hub cache folder that is not a snapshot, or None when ``folder`` is not one.

    Args:
        folder: a folder that holds no checkpoint file.

    Returns:
        A sentence naming the snapshot folder(s) to pass (the one ``refs/main`` names first), or
        None for a folder outside the hub cache layout.
    """
    if folder.name.startswith(HUB_REPO_PREFIX) and (folder / "snapshots").is_dir():
        return _repo_hint(folder, "a Hugging Face hub cache repo folder, not one of its snapshots")
    if folder.name == "snapshots" and folder.parent.name.startswith(HUB_REPO_PREFIX):
        return _repo_hint(folder.parent, "the snapshots folder of a Hugging Face hub cache repo")
    repos = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith(HUB_REPO_PREFIX))
    if repos:
        return (
            f"it is a Hugging Face hub cache folder (repos: {repos[:_SHOWN]}); pass a snapshot folder, "
            f"e.g. {str(folder / repos[0] / 'snapshots')}/<revision>."
        )
    return None


def _repo_hint(repo: Path, what: str) -> str:
    """Which snapshot folder of ``repo`` to pass: ``refs/main``'s revision first, then the others."""
    folder = repo / "snapshots"
    snapshots = sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []
    if not snapshots:
        return f"it is {what}, and it holds no snapshot: download the model again (huggingface_hub)."
    main = _main_revision(repo)
    ordered = [main] + [s for s in snapshots if s != main] if main in snapshots else snapshots
    paths = [str(repo / "snapshots" / name) for name in ordered]
    if len(paths) == 1:
        return f"it is {what}; pass the snapshot folder {paths[0]!r} instead."
    first = " (refs/main)" if main in snapshots else ""
    return f"it is {what}; pass one of its snapshot folders instead: {paths[0]!r}{first}, " + ", ".join(
        repr(p) for p in paths[1:_SHOWN]
    ) + "."


def _main_revision(repo: Path) -> str | None:
    """The revision ``refs/main`` names, or None when it is missing or unreadable."""
    try:
        return (repo / "refs" / "main").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
