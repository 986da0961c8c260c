"""A complex checkpoint tensor for a real model tensor is refused before anything is placed.

Before, the load cast it (torch warns "Casting complex values to real discards the imaginary part" for
tensors placed in memory, and nothing at all for tensors offloaded to disk) and the model ran with the
real parts only: a silent wrong result.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch, load_checkpoint_in_model


def _net() -> nn.Sequential:
    with init_empty_weights():
        return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


@pytest.fixture
def checkpoint(tmp_path):
    state = {k: v.contiguous() for k, v in nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)).state_dict().items()}
    state["1.weight"] = torch.complex(state["1.weight"], torch.ones(2, 2))
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


MESSAGE = r"Checkpoint tensor '1\.weight' is torch\.complex64 but the model's is torch\.float32: .* imaginary part"


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}, {"0": "cpu", "1": "disk"}])
def test_complex_into_real_is_refused_and_nothing_placed(checkpoint, tmp_path, device_map):
    model = _net()
    with pytest.raises(ValueError, match=MESSAGE):
        load_checkpoint_in_model(model, checkpoint, device_map=device_map, offload_folder=tmp_path / "offload")
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert not (tmp_path / "offload").exists()


def test_load_checkpoint_and_dispatch_refuses_it_too(checkpoint, tmp_path):
    with pytest.raises(ValueError, match=MESSAGE):
        load_checkpoint_and_dispatch(_net(), checkpoint, device_map="auto", max_memory={"cpu": 40},
                                     offload_folder=tmp_path / "offload")  # fmt: skip


def test_complex_into_complex_still_loads(tmp_path):
    value = torch.complex(torch.ones(3), torch.arange(3.0))
    save_file({"z": value}, tmp_path / "z.safetensors")
    module = nn.Module()
    module.register_buffer("z", torch.zeros(3, dtype=torch.complex64))
    load_checkpoint_in_model(module, tmp_path / "z.safetensors")
    assert torch.equal(module.z, value)
