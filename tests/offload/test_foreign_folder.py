"""An offload folder holding another model's offload, or a user's index.json, is never mixed silently."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import disk_offload, load_checkpoint_and_dispatch, offload_state_dict
from bigmodel.offload.storage import (
    OffloadedWeightsLoader,
    offload_weight,
    save_offload_index,
)

MAP = {"0": "disk", "2": "cpu"}


def _net(width: int = 4, seed: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_net().state_dict(), folder / "model.safetensors")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_another_models_offload_is_replaced_with_a_warning_naming_the_differing_entries(
    tmp_path: Path, checkpoint: Path
) -> None:
    folder = tmp_path / "off"
    disk_offload(_net(width=8, seed=2), folder)
    with pytest.warns(UserWarning) as record:
        model = load_checkpoint_and_dispatch(
            _net(seed=3), checkpoint, device_map=MAP, offload_folder=folder, dtype=torch.float32
        )
    message = str(record[0].message)
    assert record[0].filename == __file__  # the caller's line
    assert f"Offload folder {str(folder)!r} held 2 tensor(s)" in message, message
    assert "'0.bias': float32 [8] -> float32 [4]; '0.weight': float32 [8, 8] -> float32 [4, 4]" in message, message
    assert "its 2 other entries may still be that model's; use one offload_folder per model" in message, message
    x = torch.arange(8.0).reshape(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), _net()(x), rtol=0, atol=0)


def test_rerunning_the_same_model_into_its_folder_is_silent(tmp_path: Path, checkpoint: Path) -> None:
    folder = tmp_path / "offload"
    x = torch.arange(8.0).reshape(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for dtype in (torch.float16, torch.float16):  # .dat files written, then written again
            model = load_checkpoint_and_dispatch(_net(seed=5), checkpoint, device_map=MAP, offload_folder=folder,
                                                 dtype=dtype)  # fmt: skip
        disk_offload(_net(), tmp_path / "whole")
        disk_offload(_net(), tmp_path / "whole")
    assert sorted(json.loads((folder / "index.json").read_text())) == ["0.bias", "0.weight"]
    with torch.no_grad():
        torch.testing.assert_close(model(x.half()).float(), _net().half()(x.half()).float())


def test_a_dtype_change_under_the_same_name_warns(tmp_path: Path) -> None:
    offload_state_dict(tmp_path, {"w": torch.ones(2, 3)})
    with pytest.warns(UserWarning, match=r"held 1 tensor\(s\) .*'w': float32 \[2, 3\] -> float16 \[2, 3\]"):
        offload_state_dict(tmp_path, {"w": torch.ones(2, 3, dtype=torch.float16)})
    assert torch.equal(OffloadedWeightsLoader(save_folder=tmp_path)["w"], torch.ones(2, 3, dtype=torch.float16))


@pytest.mark.parametrize(("previous", "tail"), [({}, ""), ({"v": torch.ones(1)}, ", and its 1 other entry may")])
def test_the_replace_warning_counts_only_entries_left(tmp_path: Path, previous: dict, tail: str) -> None:
    offload_state_dict(tmp_path, {"w": torch.ones(2, 3), **previous})
    with pytest.warns(UserWarning) as record:
        offload_state_dict(tmp_path, {"w": torch.ones(3, 2)})
    message = str(record[0].message)
    assert "0 other entries" not in message, message
    assert f"(or this one's in another dtype){tail}" in message, message
    assert message.endswith("; use one offload_folder per model (or delete this one first)."), message


@pytest.mark.parametrize(
    ("content", "detail"),
    [
        ('{"mine": 1}', r"its entry 'mine' is 1, not an object with a \"dtype\""),
        (
            '{"a.weight": {"shape": [2]}}',
            r"its entry 'a\.weight' is \{\"shape\": \[2\]\}, not an object with a \"dtype\"",
        ),
        ("[1, 2]", r"it holds a JSON list, not an object of entries"),
    ],
)
def test_a_user_index_json_is_refused_and_nothing_written(
    tmp_path: Path, checkpoint: Path, content: str, detail: str
) -> None:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "index.json").write_text(content)
    message = rf"'{folder}/index\.json' is not an offload index \({detail}\); .*pass an offload_folder of its own"
    for write in (
        lambda: load_checkpoint_and_dispatch(
            _net(), checkpoint, device_map=MAP, offload_folder=folder, dtype=torch.float16
        ),
        lambda: disk_offload(_net(), folder),
        lambda: offload_state_dict(folder, {"w": torch.ones(2)}),
        lambda: save_offload_index(offload_weight(torch.ones(2), "w", tmp_path / "elsewhere"), folder),
    ):
        with pytest.raises(ValueError, match=message):
            write()
        assert _files(folder) == {"index.json": content.encode()}
