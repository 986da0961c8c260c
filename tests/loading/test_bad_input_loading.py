"""Bad input to load_checkpoint_in_model: devices the machine lacks, lying shards, dtype mismatches.

Each probe checks the error names the tensor and the fix, and that a refused load leaves the
model untouched and the checkpoint's files byte for byte as they were.  Probes of bugs whose
fix belongs to a module owned elsewhere are ``xfail(strict=True)`` with the reason.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import (
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from bigmodel.core.devices import accelerator_count, accelerator_type


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x))


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.detach().clone() for k, v in Net().state_dict().items()}


def _sums(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file(_state(), folder / "model.safetensors")
    return folder


def _absent_devices() -> list[str]:
    """Device strings naming an accelerator this machine does not have."""
    kind, count = accelerator_type(), accelerator_count()
    absent = [f"{kind}:{count}"] if kind is not None else ["cuda:7", "mps", "xpu:0"]
    return absent + (["cuda:0"] if kind not in (None, "cuda") else [])


@pytest.mark.parametrize("device", _absent_devices())
def test_a_device_the_machine_lacks_is_named_before_anything_is_placed(checkpoint, device):
    with init_empty_weights():
        model = Net()
    before = _sums(checkpoint)
    # Before the fix: torch's "Torch not compiled with CUDA enabled" (AssertionError) or
    # "invalid device ordinal" after 'a' had already been placed.
    with pytest.raises(ValueError, match=rf"puts 'b\.(bias|weight)' on '{device}'.*map it to an existing device"):
        load_checkpoint_in_model(model, checkpoint, device_map={"a": "cpu", "b": device})
    assert model.a.weight.device.type == "meta"  # nothing placed
    with pytest.raises(ValueError, match=rf"on '{device}'"):
        load_checkpoint_and_dispatch(Net(), checkpoint, device_map={"a": "cpu", "b": device})
    assert _sums(checkpoint) == before


def test_a_bad_device_spec_names_the_tensor(checkpoint):
    with init_empty_weights():
        model = Net()
    with pytest.raises(ValueError, match=r"puts 'b\.(bias|weight)' on 'gpu': Device 'gpu' is not a device spec"):
        load_checkpoint_in_model(model, checkpoint, device_map={"a": "cpu", "b": "gpu"})
    assert model.a.weight.device.type == "meta"


def test_existing_devices_still_load(checkpoint):
    model = Net()
    load_checkpoint_in_model(model, checkpoint, device_map={"a": "cpu", "b": torch.device("cpu")})
    assert torch.equal(model.b.weight, _state()["b.weight"])


def test_the_index_decides_which_shard_a_duplicated_tensor_comes_from(tmp_path):
    state = _state()
    stale = {k: torch.zeros_like(v) for k, v in state.items() if k.startswith("a.")}
    save_file({**stale, "b.weight": state["b.weight"]}, tmp_path / "m-1.safetensors")
    save_file({k: state[k] for k in ("a.weight", "a.bias", "b.bias")}, tmp_path / "m-2.safetensors")
    weight_map = {"b.weight": "m-1.safetensors", "a.weight": "m-2.safetensors", "a.bias": "m-2.safetensors",
                  "b.bias": "m-2.safetensors"}  # fmt: skip
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = Net()
    load_checkpoint_in_model(model, tmp_path)
    assert torch.equal(model.a.weight, state["a.weight"])  # bigmodel loads the zeros of m-1


def _save(tensors: dict, path: Path) -> None:
    if path.suffix == ".bin":
        torch.save(tensors, path)
    else:
        save_file(tensors, path)


@pytest.mark.parametrize("suffix", [".safetensors", ".bin"])
@pytest.mark.parametrize("device_map", [None, {"a": "disk", "b": "cpu"}])
def test_a_stale_copy_in_another_shard_never_wins(tmp_path, suffix, device_map):
    """The stale copy comes first (m-1), in memory and on disk; the copy the index names (m-2) wins.
    (An index naming a shard that lacks the tensor is refused: tests/checkpoints/test_index_agreement.py.)"""
    state = _state()
    stale = {k: torch.zeros_like(v) for k, v in state.items() if k.startswith("a.")}
    _save({**stale, "b.weight": state["b.weight"]}, tmp_path / f"m-1{suffix}")
    _save({k: state[k] for k in ("a.weight", "a.bias", "b.bias")}, tmp_path / f"m-2{suffix}")
    weight_map = {"b.weight": f"m-1{suffix}", "a.weight": f"m-2{suffix}", "a.bias": f"m-2{suffix}",
                  "b.bias": f"m-2{suffix}"}  # fmt: skip
    index = tmp_path / f"model{suffix}.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with init_empty_weights():
        model = Net()
    if device_map is None:
        model = Net()
        load_checkpoint_in_model(model, index)
    else:
        load_checkpoint_and_dispatch(model, index, device_map=device_map, offload_folder=tmp_path / "off")
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    reference = Net()
    reference.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("stored", [torch.int64, torch.bool])
def test_an_integer_checkpoint_tensor_takes_the_floating_model_dtype(tmp_path, stored):
    state = _state()
    state["a.weight"] = (state["a.weight"] * 10).to(stored)
    save_file(state, tmp_path / "model.safetensors")
    model = Net()
    load_checkpoint_in_model(model, tmp_path)
    assert model.a.weight.dtype == torch.float32
    assert torch.equal(model.a.weight, state["a.weight"].to(torch.float32))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("device_map", [{"": "cpu"}, {"a": "disk", "b": "cpu"}])
def test_an_integer_checkpoint_tensor_is_a_float_in_memory_and_on_disk(tmp_path, device_map, dtype):
    state = _state()
    state["a.weight"] = (state["a.weight"] * 10).to(torch.int64)
    save_file(state, tmp_path / "model.safetensors")
    with init_empty_weights():
        model = Net()
    load_checkpoint_and_dispatch(model, tmp_path, device_map=device_map, offload_folder=tmp_path / "off", dtype=dtype)
    expected = dtype or torch.float32
    assert model.a.weight.dtype == expected
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0), dtype=expected)
    reference = Net().to(expected)
    reference.load_state_dict({k: v.to(expected) for k, v in state.items()})
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
