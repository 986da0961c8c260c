"""``cpu_offload`` / ``disk_offload`` refuse an execution device this machine lacks when they are called.

Before, ``cpu_offload(model, execution_device="mps")`` on a machine without that accelerator hooked the
model and the first forward failed inside torch ("PyTorch is not linked with support for mps devices",
"Torch not compiled with CUDA enabled"), naming neither the argument nor the fix.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bigmodel import cpu_offload, disk_offload
from bigmodel.core.devices import accelerator_count, accelerator_type

ABSENT = ["mps", "xpu:0", "cuda:0"] if accelerator_type() is None else [f"{accelerator_type()}:{accelerator_count()}"]


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4))


@pytest.mark.parametrize("device", ABSENT)
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_an_absent_execution_device_is_refused_before_hooking(tmp_path, device: str, offload: str) -> None:
    model = _net()
    with pytest.raises(ValueError, match=rf"execution_device='{device}' is not a device of this machine.*pass an"):
        if offload == "cpu":
            cpu_offload(model, execution_device=device)
        else:
            disk_offload(model, tmp_path / "offload", execution_device=device)
    assert not hasattr(model[0], "_hf_hook")
    assert not (tmp_path / "offload").exists()


@pytest.mark.parametrize("device", ["disk", "gpu", -1])
def test_a_spec_that_is_no_execution_device_names_the_argument(device) -> None:
    with pytest.raises(ValueError, match=rf"execution_device={device!r}: "):
        cpu_offload(_net(), execution_device=device)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), None])
def test_the_cpu_still_runs(tmp_path, device) -> None:
    for offload in (cpu_offload, lambda m, execution_device: disk_offload(m, tmp_path, execution_device)):
        model = offload(_net(), execution_device=device)
        assert torch.equal(model(torch.ones(1, 4)), _net()(torch.ones(1, 4)))
