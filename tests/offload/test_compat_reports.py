"""Behaviours code written for accelerate 1.15.0 relies on, found by running the same snippet on both."""

from __future__ import annotations

import pytest
import torch

from bigmodel.utils import OffloadedWeightsLoader, offload_state_dict


def test_save_folder_is_kept_as_the_caller_gave_it(tmp_path):
    folder = str(tmp_path / "offload")
    offload_state_dict(folder, {"w": torch.ones(2)})
    loader = OffloadedWeightsLoader(save_folder=folder)
    assert loader.save_folder == folder and isinstance(loader.save_folder, str)
    assert loader.save_folder + "/index.json"  # what string-handling callers do


def test_a_save_folder_without_index_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="index.json"):
        OffloadedWeightsLoader(save_folder=str(tmp_path / "mistyped"))


def test_disk_offload_of_a_model_without_tensors_still_works(tmp_path):
    # Nothing to write, so no index.json: bigmodel's own loader is given the (empty) index.
    from bigmodel import disk_offload

    model = disk_offload(torch.nn.Sequential(torch.nn.ReLU()), str(tmp_path / "off"), execution_device="cpu")
    assert model(torch.tensor([-1.0, 2.0])).tolist() == [0.0, 2.0]


def test_a_disk_module_without_tensors_still_dispatches(tmp_path):
    from bigmodel import dispatch_model

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    expected = model(torch.ones(1, 2))
    dispatch_model(model, {"0": "cpu", "1": "disk"}, main_device="cpu", offload_dir=str(tmp_path / "off"))
    torch.testing.assert_close(model(torch.ones(1, 2)), expected, rtol=0, atol=0)
