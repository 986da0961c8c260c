"""A loader pointed at a hub cache folder that is not a snapshot says which snapshot folder to pass.

``huggingface_hub`` keeps ``models--org--name/{blobs,refs,snapshots/<revision>}``; only a snapshot
folder holds the checkpoint's files.  The repo folder, its ``snapshots/`` and the cache folder
above are refused with the snapshot folder to pass (``refs/main``'s first), not only "no weights".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import init_empty_weights, load_checkpoint_in_model
from bigmodel.integrations.hf import resolve_model_folder


def _hub_repo(root: Path, revisions: list[str], main: str | None) -> Path:
    """``root/models--org--tiny`` with one snapshot per revision, each linking a safetensors blob."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    save_file({"0.weight": torch.ones(2, 2), "0.bias": torch.zeros(2)}, repo / "blobs" / "0abc")
    for revision in revisions:
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        os.symlink("../../blobs/0abc", snapshot / "model.safetensors")
        (snapshot / "config.json").write_text("{}")
    if main is not None:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return repo


def _load(path: Path) -> nn.Module:
    with init_empty_weights():
        model = nn.Sequential(nn.Linear(2, 2))
    load_checkpoint_in_model(model, path)
    return model


@pytest.mark.parametrize("where", ["repo", "snapshots"])
def test_repo_folder_names_the_snapshot_to_pass(tmp_path: Path, where: str) -> None:
    repo = _hub_repo(tmp_path, ["r1"], "r1")
    folder = repo if where == "repo" else repo / "snapshots"
    snapshot = re.escape(str(repo / "snapshots" / "r1"))
    with pytest.raises(ValueError, match=f"hub cache repo.*pass the snapshot folder '{snapshot}' instead"):
        _load(folder)
    assert torch.equal(_load(repo / "snapshots" / "r1")[0].weight, torch.ones(2, 2))  # what the hint says loads


def test_several_snapshots_list_refs_main_first(tmp_path: Path) -> None:
    repo = _hub_repo(tmp_path, ["aaa", "bbb"], "bbb")
    with pytest.raises(ValueError, match=r"one of its snapshot folders instead: '[^']*bbb' \(refs/main\), '[^']*aaa'"):
        _load(repo)


def test_repo_without_snapshots_says_to_download_again(tmp_path: Path) -> None:
    repo = _hub_repo(tmp_path, [], None)
    (repo / "snapshots").mkdir()
    with pytest.raises(ValueError, match="holds no snapshot: download the model again"):
        _load(repo)


def test_cache_folder_names_a_repo(tmp_path: Path) -> None:
    _hub_repo(tmp_path, ["r1"], "r1")
    with pytest.raises(ValueError, match=r"hub cache folder \(repos: \['models--org--tiny'\]\); pass a snapshot"):
        _load(tmp_path)


def test_cli_model_folder_names_the_snapshot(tmp_path: Path) -> None:
    repo = _hub_repo(tmp_path, ["r1"], "r1")
    with pytest.raises(FileNotFoundError, match=r"No config.json in .*pass the snapshot folder '.*snapshots/r1'"):
        resolve_model_folder(repo)
    assert resolve_model_folder(repo / "snapshots" / "r1") == repo / "snapshots" / "r1"


def test_a_plain_empty_folder_keeps_the_plain_advice(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"holds no weights: .*\(found: \[\]\); pass the path of the weights file\.$"):
        _load(tmp_path)
