"""Decode steps side by side in one process: ``python -m benchmarks.decode_steps [--steps N] [--clock wall|cpu]``.

SmolLM2-135M (the benchmark fixture, ``.bench-cache/smollm2``; run ``python -m benchmarks --only
generate_smollm2_half_disk`` once to build it) three times: plain in memory, and dispatched with
15/30 decoder layers on disk (warm page cache) with one hook run per submodule
(``BIGMODEL_BLOCK_HOOKS=0``) and with one per block (the default).  After a prompt forward each,
one KV-cached decode step of each model runs in turn, ``--steps`` times, so that the three see
the same load on a shared machine; prints the median time per step (milliseconds; wall clock or
this thread's CPU time) and the tokens/s ratios to the plain model (of the medians, and the median
of the ratios of steps run back to back, which cancels slow drifts of a shared machine).  One thread (``torch``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from . import fixtures

PROMPT = [1, 504, 3458, 282, 253, 1345, 30, 2]


def _dispatched(folder: str, block_hooks: str, offload: str):
    import bigmodel
    from transformers import AutoConfig, AutoModelForCausalLM

    os.environ["BIGMODEL_BLOCK_HOOKS"] = block_hooks  # read when the hooks are attached
    with bigmodel.init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model.tie_weights()
    model.eval()
    device_map = fixtures.smollm2_half_disk_map(fixtures.read_manifest()["smollm2"]["num_layers"])
    return bigmodel.load_checkpoint_and_dispatch(model, folder, device_map=device_map, offload_folder=offload)


def main() -> None:
    from transformers import AutoModelForCausalLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    torch.set_num_threads(1)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    folder = str(fixtures.CACHE / "smollm2")
    with tempfile.TemporaryDirectory() as off1, tempfile.TemporaryDirectory() as off2:
        models = {
            "plain": AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
            "per submodule": _dispatched(folder, "0", off1),
            "per block": _dispatched(folder, "1", off2),
        }
        times: dict[str, list[float]] = {name: [] for name in models}
        with torch.no_grad():
            state = {}
            for name, model in models.items():
                out = model(torch.tensor([PROMPT]), use_cache=True)
                state[name] = (out.logits[:, -1:].argmax(-1), out.past_key_values)
            for _ in range(args.steps):
                for name, model in models.items():
                    token, cache = state[name]
                    t0 = clock()
                    out = model(token, past_key_values=cache, use_cache=True)
                    times[name].append(clock() - t0)
                    state[name] = (out.logits[:, -1:].argmax(-1), out.past_key_values)
    medians = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    print(f"{args.steps} decode steps, clock {args.clock}, load average at the end {load}")
    for name, ms in medians.items():
        paired = statistics.median(p / t for p, t in zip(times["plain"], times[name]))  # step by step: drift cancels
        print(f"  {name:14s} {ms:8.2f} ms/step   tokens/s vs plain {medians['plain'] / ms:.3f}"
              f"   (median of per-step ratios {paired:.3f})")
    tokens = {name: int(token.item()) for name, (token, _) in state.items()}
    print(f"  last tokens {tokens} ({'the same' if len(set(tokens.values())) == 1 else 'DIFFER'})")


if __name__ == "__main__":
    main()
