"""An empty string as an offload folder or checkpoint is refused, not read as the working directory.

``Path("")`` is ``Path(".")``: before, ``disk_offload(model, "")``, ``offload_state_dict("", ...)`` and every
load with ``offload_folder=""`` filled the working directory with ``.dat`` files and an ``index.json``,
and ``load_checkpoint_in_model(model, "")`` loaded whatever single checkpoint the working directory held.
accelerate 1.15 fails on both (``os.makedirs("")``: FileNotFoundError; ``""`` is neither file nor folder).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    OffloadedWeightsLoader,
    disk_offload,
    dispatch_model,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
    offload_state_dict,
    offload_weight,
    save_offload_index,
)

MAP = {"0": "cpu", "1": "disk"}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The working directory, holding one checkpoint (a load of ``""`` would find it)."""
    save_file(_net().state_dict(), tmp_path / "model.safetensors")
    torch.save(_net().state_dict(), tmp_path / "other.bin")
    monkeypatch.chdir(tmp_path)
    return tmp_path


CALLS = {
    "disk_offload": (lambda: disk_offload(_net(), ""), "offload_dir=''"),
    "dispatch_model": (lambda: dispatch_model(_net(), MAP, offload_dir=""), "offload_dir=''"),
    "load_checkpoint_in_model": (
        lambda: load_checkpoint_in_model(_net(), "other.bin", device_map=MAP, offload_folder=""), "offload_folder=''"
    ),
    "load_checkpoint_and_dispatch": (
        lambda: load_checkpoint_and_dispatch(_net(), "other.bin", device_map=MAP, offload_folder=" "),
        "offload_folder=' '",
    ),
    "offload_state_dict": (lambda: offload_state_dict("", _net().state_dict()), "offload_folder=''"),
    "offload_weight": (lambda: offload_weight(torch.ones(2), "w", ""), "offload_folder=''"),
    "save_offload_index": (lambda: save_offload_index({"w": {"dtype": "float32", "shape": [2]}}, ""), "offload_folder"),
    "OffloadedWeightsLoader": (lambda: OffloadedWeightsLoader(save_folder=""), "save_folder=''"),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_an_empty_offload_folder_is_refused_and_the_working_directory_untouched(workdir: Path, call: str) -> None:
    before = sorted(p.name for p in workdir.iterdir())
    function, argument = CALLS[call]
    with pytest.raises(ValueError, match=rf"{argument}.* is empty; pass the path of a folder"):
        function()
    assert sorted(p.name for p in workdir.iterdir()) == before


@pytest.mark.parametrize("checkpoint", ["", "  "])
def test_an_empty_checkpoint_is_refused_not_read_from_the_working_directory(workdir: Path, checkpoint: str) -> None:
    with pytest.raises(ValueError, match=r"checkpoint='\s*' is empty; pass a weights file"):
        load_checkpoint_in_model(_net(), checkpoint)
    with pytest.raises(FileNotFoundError):
        load_checkpoint_and_dispatch(_net(), checkpoint, device_map={"": "cpu"})


def test_a_checkpoint_that_is_no_path_is_a_type_error(workdir: Path) -> None:
    with pytest.raises(TypeError, match=r"checkpoint=None is not a path; pass a weights file"):
        load_checkpoint_in_model(_net(), None)


def test_the_working_directory_said_explicitly_still_works(workdir: Path) -> None:
    (workdir / "other.bin").unlink()
    model = load_checkpoint_and_dispatch(_net(), "./", device_map=MAP, offload_folder="./offload")
    assert torch.equal(model(torch.ones(1, 4)), _net()(torch.ones(1, 4)))
