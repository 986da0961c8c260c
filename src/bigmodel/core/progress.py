"""Progress reporting for long loads: a tqdm bar over bytes, and ``logging`` for the rest.

The bar appears only for loads that last longer than about a second (tqdm's ``delay``),
only when stderr is a terminal, and never when the environment variable
``BIGMODEL_DISABLE_PROGRESS`` is set to ``1``/``true``/``yes``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import TracebackType

logger = logging.getLogger(__name__)

DISABLE_ENV = "BIGMODEL_DISABLE_PROGRESS"
_DELAY_S = 1.0


def progress_enabled() -> bool:
    """True when a progress bar may be drawn (stderr is a TTY and the env switch is off)."""
    if os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    stream = sys.stderr
    return bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())


class ByteProgress:
    """Context manager counting bytes processed by a load; draws a bar when enabled.

    Args:
        total: bytes expected in all (used for the bar's percentage).
        desc: short label shown before the bar and in the final log line.

    Example:
        ``with ByteProgress(total, "Loading") as bar: bar.update(tensor.nbytes)``
    """

    def __init__(self, total: int, desc: str = "Loading checkpoint") -> None:
        self.total = int(total)
        self.desc = desc
        self.done = 0
        self._bar = None
        self._start = 0.0

    def __enter__(self) -> ByteProgress:
        self._start = time.perf_counter()
        if progress_enabled():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=self.total,
                desc=self.desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                delay=_DELAY_S,
                leave=False,
            )
        return self

    def update(self, nbytes: int) -> None:
        """Record ``nbytes`` more bytes processed."""
        self.done += int(nbytes)
        if self._bar is not None:
            self._bar.update(int(nbytes))

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elapsed = time.perf_counter() - self._start
        if exc_type is None:
            logger.info("%s: %.1f MiB in %.2f s", self.desc, self.done / 2**20, elapsed)
