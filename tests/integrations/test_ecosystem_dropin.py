"""Code written for the incumbent, with only its import changed, runs the same on bigmodel.

Each snippet takes the library as an argument and is run once with ``accelerate`` and once
with ``bigmodel``; the results are compared with each other and with the plain model.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

LIBS = ["accelerate", "bigmodel"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """Embedding, six 16.6 KB blocks and a head: about 110 KB in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(6)])
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


IDS = torch.tensor([[1, 4, 9, 16, 25]])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    folder = tmp_path_factory.mktemp("dropin")
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    with torch.no_grad():
        return folder, model(IDS)


def lib(name: str) -> ModuleType:
    return importlib.import_module(name)


@pytest.mark.parametrize("name", LIBS)
def test_cpu_budget_alone_offloads_to_disk(name: str) -> None:
    big = lib(name)
    with big.init_empty_weights():
        model = Net()
    device_map = big.infer_auto_device_map(model, max_memory={"cpu": "50KB"}, no_split_module_classes=["Block"])
    assert "disk" in device_map.values()
    assert list(device_map.values())[-1] == "disk"


@pytest.mark.parametrize("name", LIBS)
def test_load_checkpoint_and_dispatch_with_cpu_budget(name: str, checkpoint, tmp_path: Path) -> None:
    big = lib(name)
    folder, expected = checkpoint
    with big.init_empty_weights():
        model = Net()
    model = big.load_checkpoint_and_dispatch(
        model, str(folder), device_map="auto", max_memory={"cpu": "50KB"}, no_split_module_classes=["Block"],
        offload_folder=str(tmp_path),
    )  # fmt: skip
    assert "disk" in model.hf_device_map.values()
    assert type(model.blocks[-1]._hf_hook).__module__.split(".")[0] == name
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)


@pytest.mark.parametrize("name", LIBS)
def test_get_max_memory_then_read_the_callers_dict(name: str) -> None:
    budgets = {"cpu": "10GiB", "disk": "1000GB"}
    lib(name).utils.get_max_memory(budgets)
    assert budgets["cpu"] < 11 * 2**30  # the caller's dict now holds ints
    assert budgets == {"cpu": 10 * 2**30, "disk": 10**12}


@pytest.mark.parametrize("name", LIBS)
def test_disk_offload_then_full_state_dict(name: str, checkpoint, tmp_path: Path) -> None:
    big = lib(name)
    _, expected = checkpoint
    torch.manual_seed(0)
    model = Net().eval()
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    big.disk_offload(model, str(tmp_path / "off"), execution_device="cpu")
    assert model.head.weight.device.type == "meta"
    with torch.no_grad():
        assert torch.equal(model(IDS), expected)
    state = big.utils.modeling.get_state_dict_offloaded_model(model)
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference)
