"""A checkpoint rewritten under a live model never kills the process nor loses the user's data.

Every flow runs in a child process (tests/_mapped_flows.py): a SIGBUS there is a failed test here,
not a dead pytest.  Each asserts that the child survives, that a file saved over the source loads
back equal to the model, and that the live model's output is unchanged (or that the forward raised
a Python error naming the rewritten file).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

TESTS = Path(__file__).resolve().parents[1]
LINUX = sys.platform.startswith("linux")
NOBODY = 65534


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "BIGMODEL_DISABLE_PROGRESS": "1", **extra}


def _describe(proc: subprocess.CompletedProcess | subprocess.Popen, stderr: str) -> str:
    code = proc.returncode
    killed = f" (killed by {signal.Signals(-code).name})" if code is not None and code < 0 else ""
    return f"child exited with {code}{killed}; stderr tail:\n{stderr[-3000:]}"


def run_flow(flow: str, fmt: str, how: str, work: Path, *extra: str, env: dict | None = None) -> dict:
    """Run one flow in a child process; return its JSON result (fails the test if the child died)."""
    cmd = [sys.executable, "-m", "_mapped_flows", flow, fmt, how, str(work), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), timeout=150)
    assert proc.returncode == 0, _describe(proc, proc.stderr)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def assert_model_survived(result: dict) -> None:
    """The live model computes what it computed before, or raised a Python error naming the file."""
    if result["output_equal"]:
        return
    assert result["error"], f"the output changed silently: {result}"
    assert any(Path(p).name in result["error"] for p in result["rewritten"]), result["error"]


# ---------------------------------------------------------------- torch.save over the source


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_torch_save_of_the_live_model_over_its_source(tmp_path: Path, fmt: str) -> None:
    result = run_flow("save", fmt, "-", tmp_path)
    assert result["saved_equal"], result
    assert_model_survived(result)
    if fmt == "bin":  # the pickle is copied at load: nothing maps it, the save just works
        assert result["save_errors"] == [] and not result["mapped_after_load"]
    else:  # the writer may be interrupted once (the weights are copied meanwhile); the next save works
        assert len(result["save_errors"]) <= 1, result["save_errors"]
        if result["save_errors"]:  # then a warning names the file and says what happened
            assert "Interrupted system call" in result["save_errors"][0]
            assert f"{result['rewritten'][0]} is being rewritten" in result["stderr"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_save_pretrained_into_the_source_folder(tmp_path: Path, fmt: str) -> None:
    pytest.importorskip("transformers")
    result = run_flow("pretrained", fmt, "-", tmp_path)
    assert result["save_errors"] == [], result
    assert result["saved_equal"], result
    assert result["output_equal"], result


# ---------------------------------------------------------------- in-place rewrites by another handle


@pytest.mark.parametrize("how", ["truncate", "garbage", "process"])
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_in_place_rewrite_of_the_source(tmp_path: Path, fmt: str, how: str) -> None:
    result = run_flow("rewrite", fmt, how, tmp_path)
    assert_model_survived(result)
    if LINUX:  # safetensors stay zero-copy under a lease; pickles are copied
        assert result["mapped_after_load"] is (fmt == "safetensors"), result


def test_rewrite_after_loading_in_a_worker_thread(tmp_path: Path) -> None:
    """The lease signal reaches the main thread, which copies the weights the worker loaded."""
    result = run_flow("thread", "safetensors", "truncate", tmp_path)
    assert_model_survived(result)
    assert result["mapped_after_load"] is LINUX, result


@pytest.mark.parametrize("how", ["truncate", "garbage", "process"])
@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_in_place_rewrite_of_the_offload_folders_files(tmp_path: Path, fmt: str, how: str) -> None:
    """bin: the offload folder's own .dat files are rewritten; safetensors: the checkpoint it points into."""
    assert_model_survived(run_flow("offload", fmt, how, tmp_path))


def test_protection_can_be_turned_off_for_copies(tmp_path: Path) -> None:
    """BIGMODEL_MAPPED_WEIGHTS=copy: nothing stays mapped, every flow is safe."""
    result = run_flow("rewrite", "safetensors", "truncate", tmp_path, env=_env(BIGMODEL_MAPPED_WEIGHTS="copy"))
    assert result["output_equal"] and not result["mapped_after_load"], result


# ---------------------------------------------------------------- without root


def _run_as_nobody(flow: str, owned: bool) -> tuple[dict, list[str]]:
    """Run ``flow`` as user nobody; the parent (root, another process) rewrites the file when told."""
    work = Path(tempfile.mkdtemp(prefix="bigmodel-mapped-"))
    os.chmod(work, 0o755)
    cmd = [sys.executable, "-m", "_mapped_flows", flow, "safetensors", "parent", str(work), "--user", str(NOBODY)]
    rewritten: list[str] = []
    try:
        with subprocess.Popen(
            [*cmd, *(["--owned"] if owned else [])], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=_env(),
        ) as proc:  # fmt: skip
            for line in proc.stdout:
                if not line.startswith("READY "):
                    break
                for name in json.loads(line.removeprefix("READY ")):
                    size = os.path.getsize(name)
                    with open(name, "wb") as f:  # root rewrites the file in place
                        f.write(os.urandom(size))
                    rewritten.append(name)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            stderr = proc.stderr.read()
            proc.wait(timeout=150)
            assert proc.returncode == 0, _describe(proc, stderr)
        return json.loads(line), rewritten
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.skipif(not LINUX or os.geteuid() != 0, reason="drops root privileges to a plain user (Linux)")
@pytest.mark.parametrize("owned", [True, False], ids=["file-owned-by-the-user", "file-owned-by-root"])
def test_plain_user_survives_a_rewrite_by_another_user(owned: bool) -> None:
    """Owned files are leased (still mapped); a root-owned, world-writable file cannot be: it is copied."""
    result, rewritten = _run_as_nobody("rewrite", owned)
    assert result["uid"] == NOBODY and rewritten
    assert result["output_equal"], result
    assert result["mapped_after_load"] is owned, result


# ---------------------------------------------------------------- in this process (no rewrite)


def _tiny_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = {"weight": torch.randn(64, 64), "bias": torch.randn(64)}
    save_file(state, path) if path.suffix == ".safetensors" else torch.save(state, path)
    return state


def _linear_from(path: Path) -> torch.nn.Module:
    with init_empty_weights():
        model = torch.nn.Linear(64, 64)
    return load_checkpoint_and_dispatch(model, str(path), device_map={"": "cpu"})


def _open_fds_to(path: Path) -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == str(path.resolve()))


@pytest.mark.skipif(not LINUX, reason="reads /proc/self")
def test_bin_weights_are_copied_safetensors_weights_stay_mapped(tmp_path: Path) -> None:
    _tiny_checkpoint(tmp_path / "w.bin")
    _tiny_checkpoint(tmp_path / "w.safetensors")
    bin_model = _linear_from(tmp_path / "w.bin")
    st_model = _linear_from(tmp_path / "w.safetensors")
    maps = Path("/proc/self/maps").read_text()
    assert str((tmp_path / "w.bin").resolve()) not in maps
    assert str((tmp_path / "w.safetensors").resolve()) in maps
    assert st_model.weight.untyped_storage().nbytes() == (tmp_path / "w.safetensors").stat().st_size
    assert torch.equal(bin_model.weight, st_model.weight)


@pytest.mark.skipif(not LINUX, reason="reads /proc/self")
def test_the_guard_lets_go_of_a_file_when_its_weights_are_freed(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    state = _tiny_checkpoint(path)
    model = _linear_from(path)
    assert torch.equal(model.weight, state["weight"])
    del model
    gc.collect()
    assert _open_fds_to(path) == 0
    assert str(path.resolve()) not in Path("/proc/self/maps").read_text()
