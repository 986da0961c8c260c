"""Bad checkpoint paths: pipes, devices, dangling or looping links, odd index entries.

Each probe checks that the error names the culprit and the fix, that nothing hangs (the
cases that could block run in a subprocess with a timeout), and that the checkpoint's
files are left byte for byte as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from bigmodel import load_checkpoint_in_model

SRC = Path(__file__).resolve().parents[2] / "src"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)


def _sums(folder: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def _load_in_subprocess(checkpoint: Path) -> subprocess.CompletedProcess:
    """Run load_checkpoint_in_model on ``checkpoint`` in a child; a hang shows up as TimeoutExpired."""
    code = textwrap.dedent(
        f"""
        import sys
        from torch import nn
        from bigmodel import load_checkpoint_in_model
        try:
            load_checkpoint_in_model(nn.Linear(4, 4), {str(checkpoint)!r})
        except Exception as err:
            print(type(err).__name__, err)
            sys.exit(3)
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
@pytest.mark.parametrize("name", ["model.safetensors", "pytorch_model.bin"])
def test_a_pipe_named_like_a_checkpoint_is_refused_without_blocking(tmp_path, name):
    pipe = tmp_path / name
    os.mkfifo(pipe)
    result = _load_in_subprocess(pipe)  # before the fix: blocked forever in open()
    assert result.returncode == 3, result.stderr
    assert "ValueError" in result.stdout
    assert f"{str(pipe)!r} is not a regular file" in result.stdout


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_a_link_to_an_endless_device_is_refused_without_reading_it(tmp_path):
    link = tmp_path / "pytorch_model.bin"
    link.symlink_to("/dev/zero")
    result = _load_in_subprocess(link)  # before the fix: torch.load read /dev/zero forever
    assert result.returncode == 3, result.stderr
    assert "is not a regular file" in result.stdout


def _hub_snapshot(root: Path) -> tuple[Path, Path]:
    repo = root / "models--org--name"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    return repo, snapshot


def test_dangling_hub_link_is_named_when_the_snapshot_folder_is_passed(tmp_path):
    _, snapshot = _hub_snapshot(tmp_path)
    (snapshot / "model.safetensors").symlink_to("../../blobs/deadbeef")
    # Before the fix: "holds no weights ... (found: [])", hiding the file that is there.
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors' does not exist; it is a symbolic link to "
                       r"'\.\./\.\./blobs/deadbeef', which is missing .*download the file again"):  # fmt: skip
        load_checkpoint_in_model(Net(), snapshot)


def test_dangling_link_passed_directly_is_named_as_a_link(tmp_path):
    link = tmp_path / "model.safetensors"
    link.symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(FileNotFoundError, match=r"symbolic link to '.*gone\.safetensors', which is missing or loops"):
        load_checkpoint_in_model(Net(), link)


def test_link_loop_is_named_as_a_link(tmp_path):
    (tmp_path / "a.safetensors").symlink_to(tmp_path / "b.safetensors")
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "a.safetensors")
    with pytest.raises(FileNotFoundError, match=r"a\.safetensors' does not exist; it is a symbolic link .* loops"):
        load_checkpoint_in_model(Net(), tmp_path)


def _write_index(folder: Path, weight_map: object) -> Path:
    state = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    save_file(state, folder / "model-00001-of-00001.safetensors")
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    return index


def test_shard_name_with_a_nul_byte_names_the_entry(tmp_path):
    index = _write_index(tmp_path, {"a.weight": "model\u0000.safetensors"})
    before = _sums(tmp_path)
    # Before the fix: a bare "ValueError: embedded null byte" from os.stat.
    with pytest.raises(ValueError, match=r"entry 'a\.weight' points to shard 'model\\x00\.safetensors'"):
        load_checkpoint_in_model(Net(), index)
    assert _sums(tmp_path) == before


def test_deeply_nested_index_is_a_value_error_naming_it(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("[" * 100_000)
    # Before the fix: RecursionError, which the CLI does not turn into its one-line error.
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json' is not a sharded-checkpoint index"):
        load_checkpoint_in_model(Net(), index)


def test_a_good_sharded_checkpoint_still_loads_after_these_checks(tmp_path):
    state = {k: v.detach().clone() for k, v in Net().state_dict().items()}
    index = _write_index(tmp_path, {k: "model-00001-of-00001.safetensors" for k in state})
    save_file(state, tmp_path / "model-00001-of-00001.safetensors")
    model = Net()
    load_checkpoint_in_model(model, index)
    assert torch.equal(model.a.weight, state["a.weight"])
    assert torch.equal(model.b.bias, state["b.bias"])
