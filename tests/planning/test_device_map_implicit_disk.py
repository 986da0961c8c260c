""""disk" is always the last device of a plan, as with the incumbent, whether max_memory names it or not.

transformers (device_map="auto"), diffusers (_determine_device_map) and peft (its offload
tests) pass budgets such as {"cpu": ...} and expect what does not fit to land on "disk".
"""

from __future__ import annotations

from pathlib import Path

import accelerate
import pytest
import torch
from torch import nn

from bigmodel import (
    compute_module_sizes,
    get_balanced_memory,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)


class Stack(nn.Module):
    """Four 4,160-byte Linear(32, 32) layers."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_cpu_only_budget_puts_the_rest_on_disk_last() -> None:
    device_map = infer_auto_device_map(Stack(), max_memory={"cpu": 10_000})
    devices = list(device_map.values())
    assert "disk" in devices
    assert devices == sorted(devices, key=["cpu", "disk"].index)  # disk only after cpu
    sizes = compute_module_sizes(Stack())
    assert sum(sizes[name] for name, device in device_map.items() if device == "cpu") <= 10_000


def test_incumbent_also_puts_disk_last_for_the_same_budget() -> None:
    # The reference behaviour: the incumbent's map for the same call has "disk" as well.
    assert "disk" in accelerate.infer_auto_device_map(Stack(), max_memory={"cpu": 10_000}).values()


def test_accelerator_and_cpu_budgets_also_end_on_disk() -> None:
    device_map = infer_auto_device_map(Stack(), max_memory={0: 10_000, "cpu": 5_000})
    assert list(dict.fromkeys(device_map.values())) == [0, "cpu", "disk"]


def test_enough_budget_uses_no_disk() -> None:
    assert infer_auto_device_map(Stack(), max_memory={"cpu": "1MB"}) == {"layers": "cpu"}  # one child: its key


def test_explicit_disk_key_is_still_a_budget() -> None:
    device_map = infer_auto_device_map(Stack(), max_memory={"cpu": 10_000, "disk": "1GB"})
    assert "disk" in device_map.values()
    with pytest.raises(ValueError, match=r"fits on no device.*Raise the \"disk\" budget"):
        infer_auto_device_map(Stack(), max_memory={"cpu": 5_000, "disk": 5_000})


def test_balanced_budgets_end_on_disk() -> None:
    budgets = get_balanced_memory(Stack(), max_memory={"cpu": 10_000})
    assert "disk" in infer_auto_device_map(Stack(), max_memory=budgets).values()


def _checkpoint(folder: Path) -> tuple[Path, Stack]:
    torch.manual_seed(0)
    model = Stack().eval()
    folder.mkdir()
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder / "pytorch_model.bin", model


@pytest.mark.parametrize("device_map", ["auto", "sequential"])
def test_load_checkpoint_and_dispatch_offloads_to_disk_with_cpu_only_budget(tmp_path: Path, device_map: str) -> None:
    checkpoint, reference = _checkpoint(tmp_path / "ckpt")
    with init_empty_weights():
        model = Stack()
    model = load_checkpoint_and_dispatch(
        model, checkpoint, device_map=device_map, max_memory={"cpu": 10_000}, offload_folder=tmp_path / "offload"
    )
    assert "disk" in model.hf_device_map.values()
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_disk_in_the_plan_without_offload_folder_names_the_fix(tmp_path: Path) -> None:
    checkpoint, _ = _checkpoint(tmp_path / "ckpt")
    with init_empty_weights():
        model = Stack()
    with pytest.raises(ValueError, match="offload_folder"):
        load_checkpoint_and_dispatch(model, checkpoint, device_map="auto", max_memory={"cpu": 10_000})
