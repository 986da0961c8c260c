"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both."""

from __future__ import annotations

import pytest
import torch

from bigmodel.utils import OffloadedWeightsLoader, offload_state_dict


@pytest.mark.xfail(
    strict=True,
    reason="offload/storage.py: OffloadedWeightsLoader stores save_folder as a pathlib.Path; accelerate "
    "1.15 keeps the caller's str, and code reading hook.weights_map.dataset.save_folder concatenates "
    "or compares strings (compressed-tensors/llm-compressor collect it to find the offload dir). Fix: "
    "keep the value as given (self.save_folder = save_folder) and use Path(save_folder) internally.",
)
def test_save_folder_is_kept_as_the_caller_gave_it(tmp_path):
    folder = str(tmp_path / "offload")
    offload_state_dict(folder, {"w": torch.ones(2)})
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert loader.save_folder == folder and isinstance(loader.save_folder, str)
    assert loader.save_folder + "/index.json"  # what string-handling callers do


@pytest.mark.xfail(
    strict=True,
    reason="offload/storage.py + offload/format.py: OffloadedWeightsLoader(save_folder=<a folder with no "
    "index.json>) gives an empty mapping (load_offload_index returns {} for a missing file), so a "
    "mistyped folder fails later with a KeyError on the first weight. accelerate 1.15 raises "
    "FileNotFoundError naming <folder>/index.json. Fix: in OffloadedWeightsLoader.__init__, when index "
    "is None and save_folder has no index.json, raise FileNotFoundError naming the file and the fix.",
)
def test_a_save_folder_without_index_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="index.json"):
        OffloadedWeightsLoader(save_folder=str(tmp_path / "mistyped"))
