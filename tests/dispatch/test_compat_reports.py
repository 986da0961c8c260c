"""Public reports about dispatched models, replayed on accelerate 1.15 and on bigmodel side by side.

Each test names the report; where bigmodel deliberately differs, README's compatibility section says so.
"""

from __future__ import annotations

from pathlib import Path

import accelerate
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import bigmodel

MAP = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "head": "disk"}
IDS = torch.tensor([[1, 4, 9, 3]])


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(2)])
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    model = _Net().eval()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.no_grad():
        return tmp_path, model(IDS)


def _loaded(library, folder: Path) -> nn.Module:
    with library.init_empty_weights():
        model = _Net()
    return library.load_checkpoint_and_dispatch(model, str(folder), device_map=MAP, offload_folder=str(folder / "off"))


def test_accelerate_leaves_offloaded_weights_on_meta_when_the_hooks_are_removed(checkpoint):
    # huggingface/accelerate#3866 (PR #4078): dispatched from a checkpoint, the disk weights never lived
    # in the model, so removing the hooks leaves them on meta and .to() fails.
    folder, _ = checkpoint
    model = _loaded(accelerate, folder)
    accelerate.hooks.remove_hook_from_submodules(model)
    assert model.head.weight.is_meta and model.blocks[1][0].weight.is_meta
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        model.to("cpu")


def test_removing_the_hooks_of_an_offloaded_load_gives_a_plain_model(checkpoint):
    # The same steps on bigmodel: the disk weights come back (views of the offload folder's files) and the
    # model is a plain model again: .to() works and the outputs are the checkpoint's.
    folder, expected = checkpoint
    model = _loaded(bigmodel, folder)
    bigmodel.remove_hook_from_submodules(model)
    assert not any(tensor.is_meta for tensor in model.state_dict().values())
    assert not any("_hf_hook" in module.__dict__ for module in model.modules())
    model.to("cpu")
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
