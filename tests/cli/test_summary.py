"""Per-device usage of a device map and the CPU budget that offloads a share of the layers."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from bigmodel import init_empty_weights
from bigmodel.cli.summary import (
    DeviceUsage,
    count_layers,
    cpu_budget_for_disk_share,
    device_map_usage,
)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 10)  # 110 floats = 440 bytes
        self.b = nn.Linear(10, 10)


class Net(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, blocks: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 10)  # 800 bytes
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))  # 880 bytes each
        self.head = nn.Linear(10, 20, bias=False)  # 800 bytes
        self.head.weight = self.embed.weight  # tied: counted once


def meta_net(blocks: int = 6) -> Net:
    with init_empty_weights():
        return Net(blocks)


def test_usage_sums_bytes_layers_and_tensors_per_device() -> None:
    model = meta_net()
    device_map = {
        "embed": "cpu", "blocks.0": "cpu", "blocks.1": "cpu", "blocks.2": "disk", "blocks.3": "disk",
        "blocks.4": "disk", "blocks.5.a": 0, "blocks.5.b": "disk", "head": "cpu",
    }  # fmt: skip
    usage = device_map_usage(model, device_map)
    assert usage == [
        DeviceUsage(0, 440, 1, 2),  # the split block counts where its first tensor is
        DeviceUsage("cpu", 800 + 2 * 880, 2, 1 + 2 * 4),
        DeviceUsage("disk", 3 * 880 + 440, 3, 3 * 4 + 2),
    ]
    assert sum(u.nbytes for u in usage) == 800 + 6 * 880


def test_usage_with_dtype_and_uncovered_tensor() -> None:
    model = meta_net(1)
    assert device_map_usage(model, {"": "cpu"}, dtype="float16") == [DeviceUsage("cpu", (800 + 880) // 2, 1, 5)]
    with pytest.raises(KeyError, match=r"'blocks.0.a.weight' is not covered by the device map"):
        device_map_usage(model, {"embed": "cpu"})


def test_count_layers() -> None:
    assert count_layers(meta_net(6)) == 6
    assert count_layers(meta_net(6), ["Linear"]) == 13  # 12 in the blocks + head


@pytest.mark.parametrize(("share", "on_disk"), [(0.5, 3), (0.0, 0), (1.0, 6), (0.34, 2)])
def test_cpu_budget_puts_the_share_of_layers_on_disk(share: float, on_disk: int) -> None:
    model = meta_net(6)
    budget = cpu_budget_for_disk_share(model, share)
    from bigmodel import infer_auto_device_map

    plan = infer_auto_device_map(model, {"cpu": budget, "disk": 2**40}, ["Block"])
    usage = {u.device: u for u in device_map_usage(model, plan)}
    assert (usage["disk"].layers if "disk" in usage else 0) == on_disk
    if budget > 0:  # the smallest such budget: one byte less puts more layers on disk
        smaller = infer_auto_device_map(model, {"cpu": budget - 1, "disk": 2**40}, ["Block"])
        assert {u.device: u for u in device_map_usage(model, smaller)}["disk"].layers > on_disk


def test_share_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match=r"share=1.5 is not a fraction; pass a number between 0 and 1"):
        cpu_budget_for_disk_share(meta_net(), 1.5)


def test_tied_model_wholly_on_disk_counts_the_tie_once(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from _tiny_hf import write_tiny_llama

    from bigmodel import compute_module_sizes
    from bigmodel.integrations.hf import empty_model, load_pretrained

    folder = write_tiny_llama(tmp_path / "tied", tokenizer=False, tie=True)
    model = load_pretrained(folder, max_memory={"cpu": 0}, offload_folder=tmp_path / "off")
    assert model.hf_device_map == {"": "disk"}
    empty = empty_model(folder)
    tensors = len(list(empty.named_parameters())) + len(list(empty.named_buffers()))  # lm_head.weight once
    expected = [DeviceUsage("disk", compute_module_sizes(empty)[""], 4, tensors)]
    assert device_map_usage(empty, {"": "disk"}) == expected
    assert device_map_usage(model, model.hf_device_map) == expected  # offloading broke the tie; counted once
