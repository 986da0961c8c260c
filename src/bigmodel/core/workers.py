"""Background threads: one lazily started, one-thread executor per name.

Prefetching, storage read-ahead and the resident read each queue their jobs on their own named
thread, so that one kind of job never waits behind another; jobs of one kind run in order.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_WORKERS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def worker(name: str) -> ThreadPoolExecutor:
    """The one-thread executor called ``name`` (its thread's name prefix), started at the first call.

    Args:
        name: e.g. ``"bigmodel-prefetch"``.

    Returns:
        The same executor for every call with that name (jobs run one at a time, in order).
    """
    with _LOCK:
        executor = _WORKERS.get(name)
        if executor is None:
            executor = _WORKERS[name] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        return executor
