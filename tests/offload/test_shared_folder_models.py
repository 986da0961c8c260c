"""A model offloaded to a folder keeps its values when another model of the same names and shapes is
offloaded into that folder before the first model ran (its .dat files are mapped at dispatch)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import disk_offload, init_empty_weights, load_checkpoint_and_dispatch


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()


def test_disk_offload_of_a_second_model_leaves_the_first_alone(tmp_path: Path) -> None:
    x = torch.randn(2, 8)
    a, b = _net(0), _net(1)
    expected_a, expected_b = a(x), b(x)
    disk_offload(a, tmp_path / "off", execution_device="cpu")
    disk_offload(b, tmp_path / "off", execution_device="cpu")  # the same names and shapes, other values
    with torch.no_grad():
        assert torch.equal(a(x), expected_a)  # not b's values
        assert torch.equal(b(x), expected_b)


def test_load_checkpoint_and_dispatch_of_a_second_model_leaves_the_first_alone(tmp_path: Path) -> None:
    x = torch.randn(2, 8)
    models = {}
    for seed in (0, 1):
        source = _net(seed)
        save_file(source.state_dict(), tmp_path / f"m{seed}.safetensors")
        with init_empty_weights():
            empty = _net(seed)
        models[seed] = (source(x).detach(), load_checkpoint_and_dispatch(
            empty, str(tmp_path / f"m{seed}.safetensors"), device_map={"0": "cpu", "2": "disk"},
            offload_folder=str(tmp_path / "off"), dtype=torch.float16))  # fmt: skip  (.dat files, float16)
    with torch.no_grad():
        for seed, (expected, model) in models.items():
            assert torch.allclose(model(x.half()).float(), expected, atol=2e-2), seed



def test_mapping_at_dispatch_never_reads_a_file(tmp_path: Path, monkeypatch) -> None:
    """Where files are read instead of mapped (here BIGMODEL_MAPPED_WEIGHTS=copy; elsewhere a spent lease
    budget), dispatch reads none of them: each is read at its module's forward, as before."""
    from bigmodel.offload import format as offload_format

    monkeypatch.setenv("BIGMODEL_MAPPED_WEIGHTS", "copy")
    reads: list[str] = []
    real = offload_format.read_bytes
    monkeypatch.setattr(offload_format, "read_bytes", lambda path, *a, **k: reads.append(str(path)) or real(path, *a, **k))
    x = torch.randn(2, 8)
    a = _net(0)
    expected = a(x)
    disk_offload(a, tmp_path / "off", execution_device="cpu")
    assert reads == []
    with torch.no_grad():
        assert torch.equal(a(x), expected)
    assert sorted({Path(p).name for p in reads}) == ["0.bias.dat", "0.weight.dat", "2.bias.dat", "2.weight.dat"]
