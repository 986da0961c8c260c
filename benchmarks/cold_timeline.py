"""Timeline of cold-cache forwards: ``python -m benchmarks.cold_timeline [--forwards N] [--in-flight-mb M]``.

The 2 GB Llama fixture (``.bench-cache/llama-st``; ``python -m benchmarks --only forward_cold_600mb``
builds it) loaded as in ``forward_cold_600mb`` (600 MB CPU budget: embeddings, head and layers 0-1
on cpu, layers 2-15 on disk), one warm-up forward, then ``--forwards`` forwards of 1x128 tokens, each
after a cold sequential read of the disk layers' byte ranges and a drop of them from the page cache.
Prints per forward: its time against the read just before it, when each decoder layer started and
ended (s from the forward's start), and the GB read from the block device by then (``/proc/diskstats``,
the whole device: run it on a quiet machine).  Shows where a cold forward waits for storage.
"""

from __future__ import annotations

import argparse
import os
import shutil
import threading
import time

import torch

from . import fixtures, pagecache
from .cases import cold
from .cases._llama import empty_llama, input_ids


def _device_read_gb(device: str) -> float:
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if parts[2] == device:
                return int(parts[5]) * 512 / 1e9
    return float("nan")


def _sample(samples: list[tuple[float, float]], stop: threading.Event, device: str, start: float) -> None:
    """(seconds since ``start``, GB read from ``device``) every 20 ms until ``stop`` is set."""
    while not stop.is_set():
        samples.append((time.perf_counter() - start, _device_read_gb(device)))
        time.sleep(0.02)


def _root_device() -> str:
    dev = os.stat(fixtures.CACHE).st_dev
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if (int(parts[0]), int(parts[1])) == (os.major(dev), os.minor(dev)):
                return parts[2]
    return ""


def main() -> None:
    import bigmodel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=3)
    parser.add_argument("--in-flight-mb", type=int, help="bytes asked for and not arrived (default: bigmodel's)")
    args = parser.parse_args()
    device_map = fixtures.budget_map(fixtures.LLAMA_2GB, 600 * 10**6)
    model = empty_llama(bigmodel)
    folder = fixtures.fresh_dir("offload")
    try:
        bigmodel.load_checkpoint_and_dispatch(model, cold._CKPT, device_map=device_map, offload_folder=folder)
        _run(model, device_map, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _run(model, device_map: dict[str, str], args: argparse.Namespace) -> None:
    if args.in_flight_mb is not None:
        from bigmodel.hooks.align_hook import loading_hook_of

        hook = next(h for m in model.modules() if (h := loading_hook_of(m)) is not None)
        hook.prefetcher.readahead._reads.window = args.in_flight_mb << 20
    ranges, device, ids = cold.disk_ranges(device_map, None), _root_device(), input_ids(cold.VOCAB)
    spans: dict[str, list[float]] = {}
    t0 = [0.0]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: spans.__setitem__(f"L{i}", [time.perf_counter() - t0[0]]))
        layer.register_forward_hook(lambda m, a, o, i=i: spans[f"L{i}"].append(time.perf_counter() - t0[0]))
    with torch.no_grad():
        model(ids[:, :8])
        for _ in range(args.forwards):
            read_s, nbytes = pagecache.read_cold(ranges)
            pagecache.drop(ranges)
            samples: list[tuple[float, float]] = []
            stop = threading.Event()
            spans.clear()
            t0[0] = time.perf_counter()
            sampler = threading.Thread(target=_sample, args=(samples, stop, device, t0[0]))
            sampler.start()
            model(ids)
            total = time.perf_counter() - t0[0]
            stop.set()
            sampler.join()
            base = samples[0][1]
            print(f"forward {total:.3f} s, cold read of {nbytes / 1e9:.2f} GB just before {read_s:.3f} s: "
                  f"{total / read_s:.2f}x")
            print("  layers (start-end, s): " + " ".join(f"{k}:{v[0]:.2f}-{v[-1]:.2f}" for k, v in spans.items()))
            print("  GB read by (s): " + " ".join(f"{t:.2f}:{gb - base:.2f}" for t, gb in samples[::5]))


if __name__ == "__main__":
    main()
