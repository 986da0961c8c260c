"""Warnings attributed to the caller's code, not to the bigmodel frame that raised them."""

from __future__ import annotations

import sys

_PACKAGE = __name__.split(".")[0]


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` called by the function calling this one that points at
    the first frame outside bigmodel (the user's line, or transformers' when it calls bigmodel).

    Returns:
        1 for the warning function itself, plus one for each bigmodel frame above it.
    """
    frame = sys._getframe(1)  # the function that warns: stacklevel 1
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == _PACKAGE:
        frame = frame.f_back
        level += 1
    return level
