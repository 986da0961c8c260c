"""Failures on the accelerator copy path (simulated accelerator on the CPU, see tests/_fake_accelerator.py).

A copy that raises while a module is staged (a CUDA out-of-memory on the copy stream, a bad read)
must give its staging-ring region back: the prefetch worker is one thread shared by every
dispatched model, so a region nobody can release would block all later prefetches, and the
interpreter's exit (which joins that thread), forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from _fake_accelerator import copies_module, dispatch_as_accelerator, install
from torch import nn

from bigmodel import disk_offload

HANG_GUARD_S = 60  # generous: a join that outlives it means a thread is blocked for good (not a speed check)


class Chain(nn.Module):
    def __init__(self, n: int = 6, dim: int = 32) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


X = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def fake(monkeypatch):
    return install(monkeypatch)


def _stage_in_thread(stager, values, count: int) -> tuple[list, threading.Thread]:
    results: list = []
    thread = threading.Thread(
        target=lambda: [results.append(stager(values, torch.device("cpu")).wait()) for _ in range(count)],
        daemon=True, name="bigmodel-test-stager",
    )
    thread.start()
    thread.join(HANG_GUARD_S)
    return results, thread


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("simulated CUDA OOM on the copy stream"),
                                   RuntimeError("simulated copy failure")])
def test_a_copy_that_raises_frees_its_staging_region_and_ten_later_stages_complete(fake, error):
    stager = copies_module.DeviceStager(staging_bytes=4096)  # 4 regions of 1 KiB: the ring wraps every 4 stages
    values = {"w": torch.arange(256, dtype=torch.float32)}
    fake.fail_next_copy(error)
    with pytest.raises(type(error), match="simulated"):
        stager(values, torch.device("cpu"))
    assert stager._staging.used == 0  # the failed stage's region is free again
    results, thread = _stage_in_thread(stager, values, 10)
    assert not thread.is_alive(), "a later stage is blocked on the region the failed copy left reserved"
    assert len(results) == 10
    assert all(torch.equal(out["w"], values["w"]) for out in results)


def test_a_region_left_reserved_raises_instead_of_blocking_the_worker(fake):
    """Defence in depth: the stager is the only releaser of its ring, so waiting for a region it
    never released would wait forever; it raises and names the problem instead."""
    stager = copies_module.DeviceStager(staging_bytes=2048)
    values = {"w": torch.zeros(256)}  # 1 KiB
    stager(values, torch.device("cpu")).wait()
    stager._staging.stage(values)  # reserved and never released (what a missing release would do)
    stager._staging.stage(values)
    results: list = []
    errors: list = []

    def run():
        try:
            results.append(stager(values, torch.device("cpu")))
        except TimeoutError as error:
            errors.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "the stager waited for a region only it could release"
    assert results == [] and len(errors) == 1
    assert "never released" in str(errors[0])


def _offloaded_chain(tmp_path: Path, monkeypatch):
    dispatch_as_accelerator(monkeypatch)
    torch.manual_seed(0)
    model = Chain().eval()
    with torch.no_grad():
        expected = model(X)
    disk_offload(model, tmp_path, execution_device="cpu")
    prefetcher = model.layers[0]._hf_hook.prefetcher
    prefetcher.min_bytes = 0  # the chain's modules are below the default threshold
    stager = prefetcher.stage
    stager.staging_bytes = 8192  # grown to 16 KiB (twice a module, a power of two): the ring wraps every 3 modules
    return model, expected, prefetcher


def test_a_failed_prefetch_copy_surfaces_once_and_ten_later_forwards_are_exact(fake, tmp_path, monkeypatch):
    model, expected, prefetcher = _offloaded_chain(tmp_path, monkeypatch)
    with torch.no_grad():
        assert torch.equal(model(X), expected)  # records the order
        assert torch.equal(model(X), expected)  # prefetches through the ring
        fake.fail_next_copy(RuntimeError("simulated copy failure"))
        with pytest.raises(RuntimeError, match="simulated copy failure"):
            model(X)
        outputs, thread = [], threading.Thread(target=lambda: [outputs.append(model(X)) for _ in range(10)],
                                               daemon=True)
        thread.start()
        thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), "forwards after a failed prefetch copy hang"
    assert len(outputs) == 10 and all(torch.equal(out, expected) for out in outputs)


def test_out_of_memory_while_prefetching_reads_the_module_when_it_runs(fake, tmp_path, monkeypatch, caplog):
    """A prefetch is an optimisation: running out of device memory for it drops it, the forward succeeds."""
    model, expected, prefetcher = _offloaded_chain(tmp_path, monkeypatch)
    with torch.no_grad():
        model(X)
        model(X)
        fake.fail_next_copy(torch.OutOfMemoryError("simulated CUDA OOM on the copy stream"))
        with caplog.at_level("INFO"):
            assert torch.equal(model(X), expected)
        for _ in range(10):
            assert torch.equal(model(X), expected)
    assert "out of device memory while prefetching" in caplog.text.lower()


EXIT_SCRIPT = """
import sys, torch
sys.path[:0] = [{root!r}, {here!r}]
import pytest
from _fake_accelerator import install
from test_stager_failures import X, _offloaded_chain

patch = pytest.MonkeyPatch()  # never undone: the worker may still be staging when the interpreter exits
fake = install(patch)
model, expected, prefetcher = _offloaded_chain({folder!r}, patch)
with torch.no_grad():
    model(X)
    model(X)
    fake.fail_next_copy(RuntimeError("simulated copy failure"))
    try:
        model(X)
    except RuntimeError:
        pass
    model(X)
    model(X)
# the wrap-around prefetch of the next forward's first module is in flight or queued now
print("pending", prefetcher.pending, flush=True)
"""


def test_interpreter_exit_with_a_prefetch_in_flight_does_not_hang(tmp_path):
    here = Path(__file__).resolve().parent
    script = textwrap.dedent(EXIT_SCRIPT).format(root=str(here.parent), here=str(here), folder=str(tmp_path))
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                timeout=HANG_GUARD_S * 2)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the interpreter did not exit (prefetch worker blocked at exit): {error.stdout!r}")
    assert result.returncode == 0, result.stderr
    assert "pending 1" in result.stdout
