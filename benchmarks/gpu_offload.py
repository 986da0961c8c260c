"""GPU offload benchmark: bigmodel vs accelerate 1.15.0 vs everything on the accelerator.

A Llama-shaped bf16 model (about 8 GB: hidden 4096, intermediate 14336, GQA 32/8 heads,
vocab 32000, untied head, 17 layers) is built from a config with random weights (std 0.02)
and saved as safetensors in a temporary folder.  With only a few GB allowed on the
accelerator (``--budget``), each case runs a prefill forward (1 x 2048 tokens) and decode
forwards (1 token with the KV cache):

- ``floor``: the whole model on the accelerator (no transfer at all);
- ``bigmodel dispatch`` / ``accelerate dispatch``: ``load_checkpoint_and_dispatch`` with the
  same device map (first layers on the accelerator, the rest on the CPU);
- ``bigmodel cpu_offload`` / ``accelerate cpu_offload``: every weight on the CPU, streamed in
  per module.

Plus the bus floor: pinned (and pageable) host→device copy bandwidth of a 1 GiB buffer.
Cases are interleaved (one pass over every case per round), each figure is the median of
``--repeats`` rounds after one warm-up round.  The warm-up round's first-prefill logits are
compared (bigmodel vs accelerate bit-exact, every case vs the floor within a tolerance), and
each offloaded case reports the host→device bandwidth its forwards reach against the pinned
copy bandwidth, and how much of the copying hides behind compute (benchmarks/gpu_report.py).
Prints a markdown table and writes ``gpu_offload.json`` and ``gpu_offload.md`` into the output
folder (the JSON after every round).  Exit status 1 if a case failed or an output check did.

Usage (on a machine with an accelerator, bigmodel and accelerate==1.15.0 importable)::

    python benchmarks/gpu_offload.py OUT_DIR [--budget 3GiB] [--repeats 3] [--prefill 2048,16384]

``--preset tiny --device cpu`` runs the same code on a toy model on the CPU (a smoke test of
the script; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

try:
    from gpu_report import compare_outputs, derive, table, write
except ImportError:  # run as ``python -m benchmarks.gpu_offload``
    from .gpu_report import compare_outputs, derive, table, write

GB = 10**9
GIB = 2**30
PRESETS = {
    # ~7.9 GB in bf16: 17 x 436 MB layers + 2 x 262 MB embedding/head.
    "8gb": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=32000, num_hidden_layers=17),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=1000, num_hidden_layers=4),
}
LAYER_CLASS = "LlamaDecoderLayer"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


# ----------------------------------------------------------------------------- model and checkpoint


def make_config(preset: str):
    from transformers import LlamaConfig

    return LlamaConfig(**PRESETS[preset], max_position_embeddings=32768, tie_word_embeddings=False)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Parameters are created in ``dtype``; buffers computed explicitly in float32 (RoPE) stay float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def meta_model(config, init_empty_weights: Callable) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    with init_empty_weights(), default_dtype(torch.bfloat16):
        model = LlamaForCausalLM(config)
    return model.eval()


def write_checkpoint(config, folder: Path, device: torch.device) -> tuple[Path, int]:
    """Random bf16 weights (generated on ``device`` for speed) saved as one safetensors file."""
    from safetensors.torch import save_file

    shapes = {name: p.shape for name, p in meta_model(config, lambda: torch.device("meta")).named_parameters()}
    generator = torch.Generator(device=device).manual_seed(0)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            value = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            value = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16).mul_(0.02)
        state[name] = value.cpu()
    path = folder / "model.safetensors"
    save_file(state, str(path))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    del state
    gc.collect()
    return path, nbytes


def load_cpu_model(config, checkpoint: Path, init_empty_weights: Callable) -> torch.nn.Module:
    """The model with every weight in CPU RAM (same loader for every contender)."""
    from safetensors.torch import load_file

    model = meta_model(config, init_empty_weights)
    model.load_state_dict(load_file(str(checkpoint)), strict=True, assign=True)
    return model


# ----------------------------------------------------------------------------- cases


def setup_cases(args, config, checkpoint: Path, device: torch.device, device_map: dict) -> dict[str, Any]:
    """name -> loaded model, or name -> error text when a contender could not load."""
    cases: dict[str, Any] = {}

    def attempt(name: str, build: Callable[[], torch.nn.Module]) -> None:
        if args.cases and name not in args.cases:
            return
        log(f"loading {name}")
        start = time.perf_counter()
        try:
            cases[name] = build()
            log(f"  {name} ready in {time.perf_counter() - start:.1f} s")
        except Exception:  # a contender that fails still leaves the others measured
            cases[name] = "load failed:\n" + traceback.format_exc()
            log(cases[name])

    def floor() -> torch.nn.Module:
        from safetensors.torch import load_file
        from transformers import LlamaForCausalLM

        with torch.device(device), default_dtype(torch.bfloat16):
            model = LlamaForCausalLM(config)
        model.load_state_dict(load_file(str(checkpoint), device=str(device)), strict=True)
        return model.eval()

    libraries = {}
    try:
        import bigmodel

        libraries["bigmodel"] = bigmodel
    except ImportError:
        log("bigmodel not importable: its cases are skipped")
    try:
        import accelerate

        libraries["accelerate"] = accelerate
        if accelerate.__version__ != "1.15.0":
            log(f"warning: accelerate {accelerate.__version__}, the comparison is pinned to 1.15.0")
    except ImportError:
        log("accelerate not importable: its cases are skipped")

    attempt("floor", floor)
    for label, lib in libraries.items():
        attempt(f"{label} dispatch", lambda lib=lib: lib.load_checkpoint_and_dispatch(
            meta_model(config, lib.init_empty_weights), str(checkpoint), device_map=dict(device_map),
            no_split_module_classes=[LAYER_CLASS]).eval())
        attempt(f"{label} cpu_offload", lambda lib=lib: lib.cpu_offload(
            load_cpu_model(config, checkpoint, lib.init_empty_weights), execution_device=device).eval())
    return cases


@torch.no_grad()
def measure_case(model: torch.nn.Module, device: torch.device, prefills: list[int], steps: int,
                 vocab: int, keep: dict | None = None, name: str = "") -> dict[str, float]:
    """Seconds: one prefill forward per length, then the mean of ``steps`` decode forwards.

    With ``keep``, the first prefill's logits are stored there under ``name`` (on the CPU)."""
    result = {}
    generator = torch.Generator().manual_seed(1)
    past = None
    for i, length in enumerate(prefills):
        ids = torch.randint(0, vocab, (1, length), generator=generator).to(device)
        synchronize(device)
        start = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        synchronize(device)
        result[f"prefill_{length}_s"] = time.perf_counter() - start
        if i == 0:
            past, token = out.past_key_values, ids[:, -1:]
            if keep is not None:
                keep[name] = out.logits.detach().cpu()
        del out
    if steps > 0:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=past, use_cache=True)
            past = out.past_key_values
        synchronize(device)
        result["decode_step_s"] = (time.perf_counter() - start) / steps
    return result


def bus_bandwidth(device: torch.device, nbytes: int = GIB, repeats: int = 5) -> dict[str, float]:
    """Host→device copy bandwidth in bytes/s, pinned and pageable (median of ``repeats`` copies)."""
    if device.type == "cpu":
        return {}
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    result = {}
    for label, pin in (("pinned", True), ("pageable", False)):
        source = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
        times = []
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=pin)
            synchronize(device)
            times.append(time.perf_counter() - start)
        result[f"{label}_h2d_Bps"] = nbytes / statistics.median(times)
        del source
    return result


# ----------------------------------------------------------------------------- report


def offloaded_bytes(model_bytes: int, resident_bytes: int) -> int:
    return max(model_bytes - resident_bytes, 0)


def summarize(rounds: list[dict], cases: dict, meta: dict, checks: list[dict]) -> dict:
    medians: dict[str, dict[str, float]] = {}
    for name in cases:
        keys = {k for r in rounds for k in r.get(name, {}) if isinstance(r[name].get(k), float)}
        medians[name] = {k: statistics.median(r[name][k] for r in rounds if k in r.get(name, {})) for k in keys}
    bus = {k: statistics.median(r["bus"][k] for r in rounds if k in r.get("bus", {}))
           for k in (rounds[0].get("bus", {}) if rounds else {})}
    return {"meta": meta, "bus": bus, "medians": medians, "derived": derive(medians, bus, meta), "checks": checks,
            "rounds": rounds, "errors": {n: c for n, c in cases.items() if isinstance(c, str)}}


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for gpu_offload.json / gpu_offload.md")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8gb")
    parser.add_argument("--device", default=None, help="execution device (default: the current accelerator, index 0)")
    parser.add_argument("--budget", default="3GiB", help="memory allowed on the accelerator for the dispatch cases")
    parser.add_argument("--prefill", default="2048", help="comma-separated prefill lengths (tokens, batch 1)")
    parser.add_argument("--decode-steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", default="", help="comma-separated subset of case names (default: all)")
    parser.add_argument("--tmp", default=None, help="folder for the temporary checkpoint")
    args = parser.parse_args(argv)
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.prefill = [int(n) for n in args.prefill.split(",")]
    return args


def pick_device(spec: str | None) -> torch.device:
    if spec:
        return torch.device(spec)
    if not torch.accelerator.is_available():
        raise SystemExit("No accelerator: run on a GPU machine, or use --preset tiny --device cpu for a smoke test.")
    return torch.device(torch.accelerator.current_accelerator().type, 0)


def plan(config, budget: str, device: torch.device) -> dict:
    try:
        from bigmodel import infer_auto_device_map, init_empty_weights
    except ImportError:
        from accelerate import infer_auto_device_map, init_empty_weights
    model = meta_model(config, init_empty_weights)
    key = device.index if device.type != "cpu" else "cpu"
    max_memory = {key: budget, "cpu": "1000GiB"} if key != "cpu" else {"cpu": "1000GiB"}
    return dict(infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=[LAYER_CLASS],
                                      dtype=torch.bfloat16))


def resident_bytes(config, device_map: dict) -> int:
    """Bytes of weights the map keeps on an accelerator."""
    model = meta_model(config, lambda: torch.device("meta"))
    total = 0
    for name, param in model.named_parameters():
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        if device_map[owner] not in ("cpu", "disk"):
            total += param.numel() * param.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    device = pick_device(args.device)
    config = make_config(args.preset)
    with tempfile.TemporaryDirectory(prefix="bigmodel-gpu-bench-", dir=args.tmp) as tmp:
        log(f"writing the {args.preset} checkpoint into {tmp}")
        checkpoint, model_bytes = write_checkpoint(config, Path(tmp), device)
        device_map = plan(config, args.budget, device)
        on_device = resident_bytes(config, device_map)
        log(f"model {model_bytes / GB:.2f} GB; device map keeps {on_device / GB:.2f} GB on {device}")
        meta = {
            "preset": args.preset, "model_bytes": model_bytes, "budget": args.budget, "prefill": args.prefill,
            "decode_steps": args.decode_steps, "repeats": args.repeats, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
            "torch": torch.__version__, "python": platform.python_version(), "device_map": device_map,
            "offloaded_bytes": {"dispatch": offloaded_bytes(model_bytes, on_device), "cpu_offload": model_bytes},
            "command": " ".join([sys.executable, *sys.argv]), "cases": args.cases or "all",
        }
        for name in ("accelerate", "transformers", "bigmodel"):
            try:
                meta[name] = __import__(name).__version__
            except Exception:  # noqa: BLE001  (a missing library is reported, not fatal)
                meta[name] = None
        cases = setup_cases(args, config, checkpoint, device, device_map)
        rounds: list[dict] = []
        logits: dict[str, torch.Tensor] = {}
        checks: list[dict] = []
        for round_index in range(args.repeats + 1):  # round 0 warms up (kernels, caches, learned prefetch order)
            record: dict[str, Any] = {"bus": bus_bandwidth(device)}
            for name, model in cases.items():
                if isinstance(model, str):
                    continue
                try:
                    record[name] = measure_case(model, device, args.prefill, args.decode_steps, config.vocab_size,
                                                keep=logits if round_index == 0 else None, name=name)
                except Exception:  # noqa: BLE001
                    cases[name] = "forward failed:\n" + traceback.format_exc()
                    log(cases[name])
                    continue
                figures = ", ".join(f"{k}={v * 1e3:.1f} ms" for k, v in record[name].items())
                log(f"round {round_index} {name}: {figures}")
            if round_index == 0:
                checks = compare_outputs(logits)
                logits.clear()
                for check in checks:
                    log(f"{'PASS' if check['passed'] else 'FAIL'} {check['check']}")
            else:
                rounds.append(record)
                write(args.out, summarize(rounds, cases, meta, checks))
        summary = summarize(rounds, cases, meta, checks)
        write(args.out, summary)
        print(table(summary))
    failed = summary["errors"] or not checks or not all(check["passed"] for check in checks)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
