"""Which modules of an execution order stay in RAM between forwards while streaming the rest from storage."""

from __future__ import annotations

from collections.abc import Sequence


def spread_kept(sizes: Sequence[int], budget: float) -> list[bool]:
    """Which modules of an execution order stay in RAM between forwards (True) when they do not all
    fit: as many as ``budget`` bytes hold, spread evenly over the order.

    Spread rather than a prefix: each kept module then computes while the disk reads the next
    released one, where a kept prefix would compute with the disk idle at every forward's start.
    The positions evenly spaced for the most modules that could fit come first; where their sizes
    differ, whatever else fits is kept after them, in order.

    Args:
        sizes: bytes of each module, in execution order.
        budget: bytes the kept modules may take (nothing is kept when it is not positive).
    """
    count, used, most = len(sizes), 0, 0
    for size in sorted(sizes):  # the most modules that could fit: the smallest ones
        if used + size > budget:
            break
        used, most = used + size, most + 1
    spaced = [(2 * j + 1) * count // (2 * most) for j in range(most)]
    kept, left = [False] * count, budget
    for i in spaced + list(range(count)):
        if not kept[i] and sizes[i] <= left:
            kept[i], left = True, left - sizes[i]
    return kept
