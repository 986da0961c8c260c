"""Two processes offloading into one folder at the same time: each model keeps its own values.

Before the lock, two processes running ``load_checkpoint_and_dispatch`` of two models with the same
names and shapes into one ``offload_folder`` interleaved their renames and index rewrites: about one
load in four dispatched a model reading the other model's ``.dat`` files (wrong outputs, no error),
others failed with misleading errors (a missing temporary file, tensors "still on the meta device").
accelerate 1.15 gives wrong outputs in the same race.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from bigmodel import offload_state_dict
from bigmodel.offload.folder_lock import folder_lock, lock_file_for

SRC = Path(__file__).resolve().parents[2] / "src"

_WORKER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from safetensors.torch import save_file
    from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    seed, folder, rounds, checkpoint = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]

    def net():
        return nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])

    torch.manual_seed(seed)
    source = net().half()
    save_file(source.state_dict(), checkpoint)
    x = torch.ones(1, 64, dtype=torch.float16)
    expected = source(x)
    device_map = {str(i): "disk" if i % 2 else "cpu" for i in range(8)}
    wrong = 0
    for _ in range(rounds):
        with init_empty_weights():
            model = net()
        load_checkpoint_and_dispatch(model, checkpoint, device_map=device_map, offload_folder=folder,
                                     dtype=torch.float16)
        with torch.no_grad():
            wrong += not torch.equal(model(x), expected)
    print("wrong", wrong)
    """
)


def test_two_processes_loading_two_models_into_one_folder_keep_their_values(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    folder = tmp_path / "offload"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    workers = [
        subprocess.Popen(
            [sys.executable, str(script), str(seed), str(folder), "12", str(tmp_path / f"m{seed}.safetensors")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for seed in (1, 2)
    ]
    for worker in workers:
        out, err = worker.communicate(timeout=600)
        assert worker.returncode == 0, err[-3000:]
        assert out.split() == ["wrong", "0"], (out, err[-3000:])  # before the lock: "wrong 3" or so, or a crash


_HOLDER = textwrap.dedent(
    """
    import sys
    from bigmodel.offload.folder_lock import folder_lock

    with folder_lock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.readline()
    """
)


def test_an_offload_waits_while_another_process_holds_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "offload"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        writer = threading.Thread(target=offload_state_dict, args=(folder, {"w": torch.arange(4.0)}))
        writer.start()
        time.sleep(1.0)
        assert writer.is_alive()
        assert not folder.exists()  # nothing written while the other process holds the folder
        holder.stdin.write("\n")
        holder.stdin.flush()
        writer.join(timeout=60)
        assert not writer.is_alive()
    finally:
        holder.kill() if holder.poll() is None else None
        holder.wait()
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "w.dat"]  # no lock file in the folder
    assert lock_file_for(folder).parent != folder


def test_the_lock_is_reentrant_and_released_after_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "offload"
    with pytest.raises(RuntimeError, match="inside"), folder_lock(folder), folder_lock(str(folder) + "/"):
        raise RuntimeError("inside")
    acquired = threading.Event()

    def other_thread() -> None:
        with folder_lock(folder):
            acquired.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=30)
    assert acquired.is_set()  # released: another thread gets it at once


def test_threads_of_one_process_take_turns(tmp_path: Path) -> None:
    folder, order = tmp_path / "offload", []

    def hold(name: str, seconds: float) -> None:
        with folder_lock(folder):
            order.append(f"{name} in")
            time.sleep(seconds)
            order.append(f"{name} out")

    first = threading.Thread(target=hold, args=("a", 0.5))
    first.start()
    time.sleep(0.1)
    second = threading.Thread(target=hold, args=("b", 0))
    second.start()
    first.join(timeout=30)
    second.join(timeout=30)
    assert order == ["a in", "a out", "b in", "b out"]


def test_a_model_dispatched_from_the_folder_still_runs(tmp_path: Path) -> None:
    from bigmodel import disk_offload

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    x = torch.randn(1, 4)
    expected = model(x)
    disk_offload(model, tmp_path / "offload", execution_device="cpu")
    with torch.no_grad():
        assert torch.equal(model(x), expected)
