"""The accelerator prefetch path under load, on a real accelerator (skipped without one).

Every module here is large enough to be prefetched (a Linear of 1.48 MB, over the 1 MiB
threshold), and the staging ring for disk weights holds only two of them, so it wraps every
other module.  cpu_offload, disk_offload and a dispatch over accelerator + cpu + disk run 20
forwards each at prefetch depth 1 and 2, every output compared bit for bit with the model run
entirely on the device.  Race wideners make a missing ordering show up as wrong numbers:

- ``copy``: a ``torch.cuda._sleep`` queued on the copy stream before each copy, so copies finish
  late (a missing event wait, or a staging region reused before its copy read it, is caught);
- ``compute``: a sleep queued on the compute stream before each module, so the consumer uses the
  weights late (a missing ``record_stream``, or device memory reused early, is caught).

Plus failure injection (a copy that raises; an out-of-memory while prefetching), an interpreter
exit with a prefetch in flight, and, with two devices, a tied group split across them.  The same
logic runs on the CPU with simulated streams in test_stager_streams.py / test_stager_failures.py.

Run: ``pytest -m accelerator tests/transfer`` (scripts/accelerator_check.sh does).
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import bigmodel
from bigmodel.transfer import copies as copies_module
from bigmodel.transfer.pinned import empty_host_cache

pytestmark = [
    pytest.mark.accelerator,
    pytest.mark.skipif(not torch.accelerator.is_available(), reason="needs an accelerator (torch.accelerator)"),
]

WIDTH, HIDDEN = 512, 720  # each Linear: 512 x 720 fp32 = 1.47 MB (> the 1 MiB prefetch threshold)
FORWARDS = 20
SLEEP_CYCLES = 10_000_000  # about 5 ms at H200 clocks: long against a 1.5 MB copy (about 0.1 ms)
KINDS = ["cpu_offload", "disk_offload", "dispatch_cpu_disk"]


@pytest.fixture
def device() -> torch.device:
    return torch.device(torch.accelerator.current_accelerator().type, 0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, HIDDEN)
        self.down = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(64, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


MAP = {"embed": 0, "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "cpu", "blocks.3": "disk", "head": 0}


def _net() -> Net:
    torch.manual_seed(0)
    return Net().eval()


def _inputs() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(4, 32, 64, generator=generator) for _ in range(FORWARDS)]


def _reference(device: torch.device, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    model = _net().to(device)
    with torch.no_grad():
        return [model(x.to(device)).cpu() for x in inputs]


def _offloaded(kind: str, device: torch.device, tmp_path, depth: int) -> nn.Module:
    model = _net()
    if kind == "cpu_offload":
        bigmodel.cpu_offload(model, execution_device=device)
    elif kind == "disk_offload":
        bigmodel.disk_offload(model, tmp_path, execution_device=device)
    else:
        bigmodel.dispatch_model(model, {k: device.index if v == 0 else v for k, v in MAP.items()}, offload_dir=tmp_path)
    prefetcher = model.blocks[1].up._hf_hook.prefetcher
    assert prefetcher is not None and isinstance(prefetcher.stage, copies_module.DeviceStager)
    prefetcher.depth = depth
    # 1 MiB asked: the ring grows to twice the largest module, rounded up to a power of two (4 MiB),
    # where two of these modules fit, not three: it wraps every other module.
    prefetcher.stage.staging_bytes = 2**20
    return model


def _sleep_on_copy_stream(monkeypatch) -> None:
    real = copies_module._device_copy

    def late_copy(tensor, target):
        torch.cuda._sleep(SLEEP_CYCLES)  # on the current stream: the copy stream here
        return real(tensor, target)

    monkeypatch.setattr(copies_module, "_device_copy", late_copy)


def _sleep_on_compute_stream(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.LayerNorm)):
            module.register_forward_pre_hook(lambda *args: torch.cuda._sleep(SLEEP_CYCLES))


@pytest.mark.parametrize("widener", ["none", "copy", "compute"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_twenty_prefetched_forwards_equal_the_model_on_device(kind, depth, widener, device, tmp_path, monkeypatch):
    if widener != "none" and device.type != "cuda":
        pytest.skip("the race wideners use torch.cuda._sleep")
    inputs = _inputs()
    expected = _reference(device, inputs)
    model = _offloaded(kind, device, tmp_path, depth)
    if widener == "copy":
        _sleep_on_copy_stream(monkeypatch)
    elif widener == "compute":
        _sleep_on_compute_stream(model)
    stager = model.blocks[1].up._hf_hook.prefetcher.stage
    with torch.no_grad():
        outputs = [model(x.to(device)) for x in inputs]  # queued back to back: no sync between forwards
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        assert torch.equal(out.cpu(), ref), f"forward {i} differs from the model on {device}"
    assert len(stager._streams) == 1 and next(iter(stager._streams)) == device
    if kind != "cpu_offload":  # disk weights went through the ring, which holds only two large modules
        assert stager._staging is not None and stager._staging.pinned
        assert stager._staging.capacity < 3 * (WIDTH * HIDDEN * 4)


@pytest.mark.parametrize("kind", ["disk_offload", "dispatch_cpu_disk"])
def test_a_copy_that_raises_fails_one_forward_then_ten_are_exact(kind, device, tmp_path, monkeypatch):
    inputs = _inputs()[:12]
    expected = _reference(device, inputs)
    model = _offloaded(kind, device, tmp_path, 1)
    real, fail = copies_module._device_copy, [False]

    def flaky(tensor, target):
        if fail[0]:
            fail[0] = False
            raise RuntimeError("injected copy failure")
        return real(tensor, target)

    monkeypatch.setattr(copies_module, "_device_copy", flaky)
    with torch.no_grad():
        assert torch.equal(model(inputs[0].to(device)).cpu(), expected[0])
        fail[0] = True
        with pytest.raises(RuntimeError, match="injected copy failure"):
            model(inputs[1].to(device))
        for x, ref in zip(inputs[2:], expected[2:]):
            assert torch.equal(model(x.to(device)).cpu(), ref)


def test_out_of_memory_while_prefetching_reads_the_module_when_it_runs(device, tmp_path, monkeypatch, caplog):
    inputs = _inputs()[:6]
    expected = _reference(device, inputs)
    model = _offloaded("disk_offload", device, tmp_path, 1)
    real, fail = copies_module._device_copy, [False]

    def out_of_memory_once(tensor, target):
        if fail[0]:
            fail[0] = False
            raise torch.OutOfMemoryError("injected out of memory on the copy stream")
        return real(tensor, target)

    monkeypatch.setattr(copies_module, "_device_copy", out_of_memory_once)
    with torch.no_grad(), caplog.at_level("WARNING"):
        model(inputs[0].to(device))
        fail[0] = True
        for x, ref in zip(inputs, expected):
            assert torch.equal(model(x.to(device)).cpu(), ref)
    assert "Out of device memory while prefetching" in caplog.text


def test_execution_device_without_index_stages_on_the_current_device(device, tmp_path):
    inputs = _inputs()[:4]
    expected = _reference(device, inputs)
    model = _net()
    bigmodel.disk_offload(model, tmp_path, execution_device=device.type)  # "cuda": the current device
    with torch.no_grad():
        for x, ref in zip(inputs, expected):
            assert torch.equal(model(x.to(device)).cpu(), ref)
    assert set(model.blocks[1].up._hf_hook.prefetcher.stage._streams) == {device}


EXIT_SCRIPT = """
import torch, bigmodel
from torch import nn
from bigmodel.transfer import copies
real = copies._device_copy
def late(tensor, target):
    torch.cuda._sleep({cycles})
    return real(tensor, target)
copies._device_copy = late
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(512, 720) if i % 2 == 0 else nn.Linear(720, 512) for i in range(8)]).eval()
bigmodel.disk_offload(model, {folder!r}, execution_device="{device}")
with torch.no_grad():
    for _ in range(3):
        model(torch.randn(2, 512, device="{device}"))
print("pending", model[0]._hf_hook.prefetcher.pending, flush=True)
"""


def test_interpreter_exit_with_a_prefetch_in_flight(device, tmp_path):
    if device.type != "cuda":
        pytest.skip("the in-flight copy is held back with torch.cuda._sleep")
    script = textwrap.dedent(EXIT_SCRIPT).format(cycles=SLEEP_CYCLES * 20, folder=str(tmp_path), device=device)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pending 1" in result.stdout


def _pinned_bytes_held() -> int | None:
    """Bytes torch's pinned host allocator owns (in use + cached), or None if this torch does not say."""
    stats = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    for key in ("reserved_bytes.current", "allocated_bytes.current"):  # older / newer torch
        if key in stats:
            return int(stats[key])
    return None


def test_deleting_an_offloaded_model_gives_its_pinned_memory_back(device):
    if device.type != "cuda" or _pinned_bytes_held() is None:
        pytest.skip("needs torch.cuda.host_memory_stats")
    gc.collect()
    empty_host_cache()
    before = _pinned_bytes_held()
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(64)]).eval()  # 268 MB
    bigmodel.cpu_offload(model, execution_device=device)
    with torch.no_grad():
        model(torch.randn(2, 1024, device=device))
    prefetcher = model[0]._hf_hook.prefetcher
    for future in list(prefetcher._pending.values()):
        future.result()  # no copy in flight: a block still being read stays cached until a later trim
    torch.accelerator.synchronize()
    held = _pinned_bytes_held()
    assert held - before >= 200 * 10**6
    del model, prefetcher
    gc.collect()
    after = _pinned_bytes_held()
    assert after - before < 64 * 10**6, (before, held, after)


@pytest.mark.skipif(torch.accelerator.device_count() < 2, reason="needs two accelerators")
@pytest.mark.parametrize("entry", ["dispatch_model", "load_checkpoint_and_dispatch"])
def test_a_tied_group_split_across_two_accelerators_runs(entry, tmp_path):
    from safetensors.torch import save_file

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(100, 64)
            self.mid = nn.Linear(64, 64)
            self.head = nn.Linear(64, 100, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.mid(self.emb(ids)))

    kind = torch.accelerator.current_accelerator().type
    torch.manual_seed(0)
    model = Tied().eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        expected = copy.deepcopy(model).to(f"{kind}:0")(ids.to(f"{kind}:0")).cpu()
    device_map = {"emb": 0, "mid": 1, "head": 1}
    if entry == "dispatch_model":
        bigmodel.dispatch_model(model, device_map)
    else:
        save_file({k: v for k, v in model.state_dict().items() if k != "head.weight"}, str(tmp_path / "model.safetensors"))
        with bigmodel.init_empty_weights():
            model = Tied().eval()
        bigmodel.load_checkpoint_and_dispatch(model, str(tmp_path), device_map=device_map)
    assert model.head.weight.device == torch.device(kind, 1) and model.emb.weight.device == torch.device(kind, 0)
    with torch.no_grad():
        assert torch.equal(model(ids.to(f"{kind}:0")).cpu(), expected)
