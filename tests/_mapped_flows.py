"""Flows that rewrite a checkpoint under a live model (helper for tests/loading/test_mapped_safety.py).

Each flow runs in its own process so that a SIGBUS kills only that process and shows as a failed
test.  Usage::

    python -m _mapped_flows FLOW FORMAT HOW WORKDIR [--user UID] [--owned]

FLOW: ``save`` (``torch.save`` of the live model over its source), ``rewrite`` (another handle
rewrites the source in place), ``offload`` (another handle rewrites the files the offload folder
reads), ``pretrained`` (``save_pretrained(..., safe_serialization=False)`` of a tiny transformers
model into its source folder), ``thread`` (``rewrite`` with the model loaded in a worker thread).
FORMAT: ``bin`` or ``safetensors``.  HOW (how the file is rewritten): ``truncate`` (``open(path,
"wb")`` and close), ``garbage`` (``open(path, "wb")`` then random bytes of the same length),
``process`` (another process does ``garbage``), ``parent`` (the parent process rewrites it: the
child prints ``READY`` with the paths and waits for a line on stdin).  ``--user UID`` drops root
to UID before loading; ``--owned`` gives the files to UID first (otherwise they stay root's, mode
0666); the interpreter may not be readable by UID, so everything is imported before.

Prints one JSON line: ``output_equal`` (the live model's output after the rewrite equals the one
before), ``error`` (the Python error the forward raised, if any), ``saved_equal`` (the file saved
over the source loads back equal to the model), ``save_errors`` (errors of failed save attempts),
``mapped_after_load`` (the source file is memory-mapped by the process after loading).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

WIDTH = 256  # 256 KiB per float32 weight: several pages


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.c = nn.Linear(WIDTH, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _mapped(path: Path) -> bool:
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return str(path.resolve()) in maps


def _rewrite(path: Path, how: str) -> None:
    """Rewrite ``path`` in place (same inode) as another handle or process would."""
    size = path.stat().st_size
    if how == "truncate":
        open(path, "wb").close()
    elif how == "garbage":
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    elif how == "parent":
        print("READY " + json.dumps([str(path)]), flush=True)
        sys.stdin.readline()
    elif how == "process":
        code = "import os, sys; open(sys.argv[1], 'wb').write(os.urandom(int(sys.argv[2])))"
        subprocess.run([sys.executable, "-c", code, str(path), str(size)], check=True, timeout=120)
    else:
        raise ValueError(how)


def _write_checkpoint(folder: Path, fmt: str) -> Path:
    """The net's checkpoint in ``folder`` (written once: a second call returns the existing file)."""
    path = folder / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    if path.exists():
        return path
    torch.manual_seed(0)
    state = Net().state_dict()
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "bin":
        torch.save(state, path)
    else:
        save_file(state, path)
    return path


def _load_net(path: Path, device_map: dict, offload: Path | None = None) -> nn.Module:
    from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = Net()
    return load_checkpoint_and_dispatch(model, str(path), device_map=device_map, offload_folder=offload)


def _forward(model: nn.Module, x: torch.Tensor, ref: torch.Tensor, result: dict) -> None:
    try:
        with torch.no_grad():
            out = model(x)
        result["output_equal"] = bool(torch.equal(out, ref))
    except Exception as err:  # the guarantee allows a Python error naming the file
        result["output_equal"] = False
        result["error"] = f"{type(err).__name__}: {err}"


def _save_over(model: nn.Module, path: Path, expected: dict, result: dict) -> None:
    """``torch.save`` of the live model over its source; a failed attempt is recorded and tried once more."""
    for _ in range(2):
        try:
            torch.save(model.state_dict(), path)
            break
        except Exception as err:
            result["save_errors"].append(f"{type(err).__name__}: {err}")
    with open(path, "rb") as f:  # a file object: torch.load would read a *.safetensors path as safetensors
        saved = torch.load(f, weights_only=True)
    result["saved_equal"] = saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)


def flow_net(flow: str, fmt: str, how: str, work: Path, result: dict) -> None:
    """``save``, ``rewrite``, ``thread`` and ``offload`` on a three-layer net."""
    path = _write_checkpoint(work / "ckpt", fmt)
    device_map = {"a": "cpu", "b": "disk", "c": "cpu"} if flow == "offload" else {"": "cpu"}
    offload = work / "offload" if flow == "offload" else None
    if flow == "thread":
        import bigmodel  # noqa: F401  (imported by the main thread, as an application does; loaded by a worker)

        box: list = []
        worker = threading.Thread(target=lambda: box.append(_load_net(path, device_map)))
        worker.start()
        worker.join()
        model = box[0]
    else:
        model = _load_net(path, device_map, offload)
    result["mapped_after_load"] = _mapped(path)
    torch.manual_seed(1)
    x = torch.randn(4, WIDTH)
    with torch.no_grad():
        ref = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if flow == "save":
        _save_over(model, path, state, result)
    elif flow == "offload":
        targets = sorted(offload.rglob("*.dat")) if fmt == "bin" else [path]
        assert targets, "the offload folder holds no .dat file"
        for target in targets:
            _rewrite(target, how)
        result["rewritten"] = [str(t) for t in targets]
    else:
        _rewrite(path, how)
    result["rewritten"] = result.get("rewritten", [str(path)])
    _forward(model, x, ref, result)


def flow_pretrained(fmt: str, work: Path, result: dict) -> None:
    """``save_pretrained(folder, safe_serialization=False)`` into the folder the model was loaded from."""
    import transformers
    from _tiny_hf import write_tiny_llama

    from bigmodel import init_empty_weights, load_checkpoint_and_dispatch

    folder = write_tiny_llama(work / "tiny", tokenizer=False)
    if fmt == "bin":  # the legacy layout: config.json + pytorch_model.bin
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
        del model
    config = transformers.AutoConfig.from_pretrained(str(folder))
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = load_checkpoint_and_dispatch(model, str(folder), device_map={"": "cpu"})
    source = folder / ("pytorch_model.bin" if fmt == "bin" else "model.safetensors")
    result["mapped_after_load"] = _mapped(source)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        ref = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model.save_pretrained(str(folder), safe_serialization=False)
    except Exception as err:
        result["save_errors"].append(f"{type(err).__name__}: {err}")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).state_dict()
    result["saved_equal"] = all(torch.equal(reloaded[k], v) for k, v in state.items() if k in reloaded)
    result["rewritten"] = [str(source)]
    try:
        with torch.no_grad():
            result["output_equal"] = bool(torch.equal(model(ids).logits, ref))
    except Exception as err:
        result["output_equal"] = False
        result["error"] = f"{type(err).__name__}: {err}"


def _drop_root(uid: int, work: Path, owned: bool) -> None:
    """Give the work folder to ``uid`` (or open it to everyone, root keeping it) and become ``uid``."""
    for root, dirs, files in os.walk(work):
        for name in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in files)]:
            if owned:
                os.chown(name, uid, uid)
            else:
                os.chmod(name, 0o777 if os.path.isdir(name) else 0o666)
    os.setgid(uid)
    os.setuid(uid)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("flow")
    parser.add_argument("fmt")
    parser.add_argument("how")
    parser.add_argument("work", type=Path)
    parser.add_argument("--user", type=int)
    parser.add_argument("--owned", action="store_true")
    args = parser.parse_args()
    result: dict = {"output_equal": None, "error": None, "saved_equal": None, "save_errors": []}
    if args.user is not None:
        warm = _write_checkpoint(args.work / "warm", args.fmt)  # a first load as root imports every module:
        _load_net(warm, {"": "cpu"})  # the interpreter's own files may be unreadable to the user
        shutil.rmtree(warm.parent)
        _write_checkpoint(args.work / "ckpt", args.fmt)  # written by root, then handed over or opened up
        _drop_root(args.user, args.work, args.owned)
        result["uid"] = os.getuid()
    if args.flow == "pretrained":
        flow_pretrained(args.fmt, args.work, result)
    else:
        flow_net(args.flow, args.fmt, args.how, args.work, result)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
