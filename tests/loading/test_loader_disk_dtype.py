"""``dtype=`` applies to the modules a device map sends to disk, as it does to those in memory.

A model built in float32 and loaded with ``dtype=torch.bfloat16`` computes in bfloat16 on
every device, disk included: its disk placeholders (meta tensors) take the dtype, so the
offload hook does not cast the bfloat16 weights back to float32.  Each test runs once with
accelerate and once with bigmodel (only the import differs) and compares with the model
loaded whole in that dtype.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

LIBS = ["accelerate", "bigmodel"]
IDS = torch.tensor([[1, 4, 9, 16, 25]])
DISK_MAP = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "disk", "head": "disk"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.norm = nn.LayerNorm(64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.norm(self.up(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[torch.dtype, torch.Tensor]]:
    """A float32 safetensors checkpoint, and the outputs of the model loaded whole in each dtype."""
    torch.manual_seed(0)
    model = Net().eval()
    folder = tmp_path_factory.mktemp("diskdtype")
    save_file(model.state_dict(), str(folder / "model.safetensors"))
    outputs = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            outputs[dtype] = copy.deepcopy(model).to(dtype)(IDS)
    return folder, outputs


@pytest.mark.parametrize("name", LIBS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_reaches_the_disk_modules(name: str, dtype: torch.dtype, checkpoint, tmp_path: Path) -> None:
    big = importlib.import_module(name)
    folder, outputs = checkpoint
    with big.init_empty_weights():
        model = Net()
    model = big.load_checkpoint_and_dispatch(
        model, str(folder), device_map=dict(DISK_MAP), offload_folder=str(tmp_path / "off"), dtype=dtype
    )
    assert {n: p.dtype for n, p in model.named_parameters() if p.dtype != dtype} == {}
    assert model.head.weight.device.type == "meta"
    with torch.no_grad():
        out = model(IDS)
    assert out.dtype == dtype
    assert torch.equal(out, outputs[dtype])


@pytest.mark.parametrize("name", LIBS)
def test_without_dtype_the_disk_modules_keep_the_model_dtype(name: str, checkpoint, tmp_path: Path) -> None:
    big = importlib.import_module(name)
    folder, outputs = checkpoint
    with big.init_empty_weights():
        model = Net()
    model = big.load_checkpoint_and_dispatch(
        model, str(folder), device_map=dict(DISK_MAP), offload_folder=str(tmp_path / "off")
    )
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with torch.no_grad():
        assert torch.equal(model(IDS), outputs[torch.float32])


def test_dtype_on_disk_with_load_checkpoint_in_model_then_dispatch(checkpoint, tmp_path: Path) -> None:
    """The two-call form (load, then dispatch_model with the offload folder) gives the same."""
    import bigmodel

    folder, outputs = checkpoint
    with bigmodel.init_empty_weights():
        model = Net()
    bigmodel.load_checkpoint_in_model(
        model, str(folder), device_map=DISK_MAP, offload_folder=str(tmp_path / "off"), dtype="bfloat16"
    )
    placeholders = {n: (p.device.type, p.dtype) for n, p in model.named_parameters() if n.startswith("head")}
    assert placeholders == {"head.weight": ("meta", torch.bfloat16), "head.bias": ("meta", torch.bfloat16)}
    model = bigmodel.dispatch_model(model, DISK_MAP, offload_dir=str(tmp_path / "off"))
    with torch.no_grad():
        assert torch.equal(model(IDS), outputs[torch.bfloat16])
