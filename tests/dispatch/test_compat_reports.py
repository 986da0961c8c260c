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


@pytest.mark.parametrize("library", [accelerate, bigmodel], ids=["accelerate", "bigmodel"])
def test_a_one_device_dispatch_of_weights_still_on_meta_raises_not_implemented_error(library):
    # 1038lab/ComfyUI-QwenVL#53 (and many alike): dispatch_model with a one-device map moves the model
    # with .to(), which fails on tensors that were never loaded.  Both raise NotImplementedError.
    with library.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(NotImplementedError):
        library.dispatch_model(model, {"": "cpu"})


def test_the_one_device_dispatch_error_names_the_tensors_and_the_fix():
    # accelerate passes torch's "Cannot copy out of meta tensor; no data!" through; bigmodel names the
    # tensors without values and how to give them one (also a ValueError), and leaves the model as it was.
    with bigmodel.init_empty_weights():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].weight = nn.Parameter(torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"3 tensor\(s\) of Sequential are on the meta device.*0\.bias, 1\.weight, "
                                         r"1\.bias.*load_checkpoint_and_dispatch.*to_empty"):  # fmt: skip
        bigmodel.dispatch_model(model, {"": "cpu"})
    assert model[1].weight.is_meta and not model[0].weight.is_meta
    assert not hasattr(model, "hf_device_map")


def _other_weights() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(1)
    other = _Net().eval()
    with torch.no_grad():
        return other.state_dict(), other(IDS)


def test_accelerate_load_state_dict_leaves_offloaded_layers_with_their_old_values(checkpoint):
    # Loading fine-tuned weights into a dispatched model: accelerate copies into the meta placeholders
    # (a no-op, with torch's "copying ... to a meta parameter" warning), so the disk layers keep the old
    # values and the model computes with a mix of both.
    folder, expected = checkpoint
    state, other_output = _other_weights()
    model = _loaded(accelerate, folder)
    with pytest.warns(UserWarning, match="to a meta parameter"):
        model.load_state_dict(state)
    with torch.no_grad():
        out = model(IDS)
    assert not torch.equal(out, other_output) and not torch.equal(out, expected)


def test_load_state_dict_reaches_the_offloaded_layers(checkpoint):
    # On bigmodel an op on a placeholder acts on the value in the weights map, so load_state_dict's copy
    # reaches the disk layers too: the model computes with the new weights, as a plain model would.  The
    # values change in memory only: the checkpoint (and a fresh load of it) keep the old ones.
    folder, expected = checkpoint
    state, other_output = _other_weights()
    model = _loaded(bigmodel, folder)
    model.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(IDS), other_output)
        assert torch.equal(model(IDS), other_output)
        assert torch.equal(_loaded(bigmodel, folder)(IDS), expected)
