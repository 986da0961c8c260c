"""Protected file mappings (bigmodel.core.file_maps, bigmodel.core.leases): policy, copies, identity, lost pages.

The flows that rewrite a file under a live model are in tests/loading/test_mapped_safety.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bigmodel.checkpoints.files import SafetensorsFile
from bigmodel.core.file_maps import POLICY_ENV, is_mapped, map_file, read_bytes

LINUX = sys.platform.startswith("linux")


def _safetensors(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    state = {"w": torch.randn(300, 300), "b": torch.randn(300)}
    save_file(state, path)
    return state


def test_unknown_policy_is_refused_with_the_accepted_values(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "w.safetensors"
    _safetensors(path)
    monkeypatch.setenv(POLICY_ENV, "sometimes")
    with pytest.raises(ValueError, match=rf"{POLICY_ENV}='sometimes'.*'auto', 'copy', 'map'"):
        map_file(path, path.stat().st_size)


def test_copy_policy_reads_tensors_into_memory(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "w.safetensors"
    state = _safetensors(path)
    monkeypatch.setenv(POLICY_ENV, "copy")
    assert map_file(path, path.stat().st_size) is None
    tensor = SafetensorsFile(path).tensor("w")
    assert torch.equal(tensor, state["w"]) and not is_mapped(tensor)


@pytest.mark.skipif(not LINUX, reason="protected mappings (read leases) are Linux's")
def test_protected_mapping_is_a_zero_copy_view(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    state = _safetensors(path)
    tensor = SafetensorsFile(path).tensor("w")
    assert torch.equal(tensor, state["w"]) and is_mapped(tensor)
    assert tensor.untyped_storage().nbytes() == path.stat().st_size
    assert not is_mapped(tensor.clone())


def test_read_bytes_names_a_file_that_ends_early(tmp_path: Path) -> None:
    path = tmp_path / "short.dat"
    path.write_bytes(b"x" * 10)
    assert read_bytes(path, 2, 8).tolist() == [ord("x")] * 8
    with pytest.raises(ValueError, match=r"short\.dat' ends at byte 10, before the 16 bytes"):
        read_bytes(path, 0, 16)


@pytest.mark.parametrize("policy", ["auto", "copy"])
def test_a_file_replaced_after_its_header_was_read_is_refused(tmp_path: Path, monkeypatch, policy: str) -> None:
    monkeypatch.setenv(POLICY_ENV, policy)
    path = tmp_path / "w.safetensors"
    _safetensors(path, seed=0)
    handle = SafetensorsFile(path)
    torch.save({"other": torch.zeros(3)}, tmp_path / "x")
    os.replace(tmp_path / "x", path)  # another file now has this name: offsets from the old header are wrong
    with pytest.raises(ValueError, match=r"w\.safetensors' changed after its header was read"):
        handle.tensor("w")


_LOST_PAGES = r"""
import os, sys, torch
from pathlib import Path
from bigmodel.core import file_maps, leases
path = Path(sys.argv[1])
path.write_bytes(os.urandom(5 * 4096 + 100))
storage = file_maps.map_file(path, path.stat().st_size)
view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (path.stat().st_size,))
first = view[:4096].clone()
entry = next(iter(file_maps._files.values()))
lease = entry.lease
fd, lease.fd = lease.fd, -1     # as if the kernel had given the lease up (break time over) ...
os.close(fd)
os.truncate(path, 4096)          # ... and the writer had truncated the file
copied, lost = leases.copy_mappings_to_memory(lease)
assert (copied, lost) == (4096, 5 * 4096), (copied, lost)
assert torch.equal(view[:4096], first) and int(view[4096:].sum()) == 0   # no SIGBUS: the rest reads zeros
print("ok")
"""


@pytest.mark.skipif(not LINUX, reason="read leases are Linux's")
def test_copy_never_touches_pages_past_the_end_of_a_truncated_file(tmp_path: Path) -> None:
    """The last resort (lease already gone, file truncated): copy what is left, zeros elsewhere, no SIGBUS."""
    env = {**os.environ, POLICY_ENV: "auto"}
    proc = subprocess.run(
        [sys.executable, "-c", _LOST_PAGES, str(tmp_path / "f.dat")], capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])
