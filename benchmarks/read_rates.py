"""Storage read rates by request shape: ``python -m benchmarks.read_rates [CHUNK_MBxTHREADS ...] [--rounds N]``.

Reads the disk layers' bytes of ``forward_cold_600mb`` (1.41 GB of the 2 GB fixture's shards; ``python -m
benchmarks --only forward_cold_600mb`` builds it) with ``O_DIRECT``, ``THREADS`` ``preadv`` calls of
``CHUNK_MB`` in flight into buffers made once, dropping those bytes from the page cache before each read.
The shapes are alternated round by round (the device's speed drifts from minute to minute); prints GB/s
per round and the median.  Shows how many bytes in flight the device needs for its full rate (session 15:
4 x 24 MB read 1.3-2.2 GB/s where 4 x 128 MB and 8 x 12 MB read 3.0-3.3).
"""

from __future__ import annotations

import argparse
import statistics

from . import fixtures, pagecache
from .cases import cold


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=["128x4", "24x4", "12x8", "48x4"])
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    ranges = cold.disk_ranges(fixtures.budget_map(fixtures.LLAMA_2GB, 600 * 10**6), None)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes]
    readers = {shape: pagecache.DirectReader(shape[0] << 20, shape[1]) for shape in shapes}
    rates: dict[tuple[int, ...], list[float]] = {shape: [] for shape in shapes}
    for _ in range(args.rounds):
        for shape in shapes:
            pagecache.drop(ranges)
            seconds, nbytes = readers[shape].read(ranges)
            rates[shape].append(nbytes / seconds / 1e9)
    pagecache.drop(ranges)
    for (chunk, threads), values in rates.items():
        print(f"{chunk} MB x {threads}: " + " ".join(f"{v:.2f}" for v in values)
              + f" GB/s, median {statistics.median(values):.2f}")


if __name__ == "__main__":
    main()
