"""The child side: one measurement of one implementation in a fresh process.

Children are forked from a fork server that has imported torch and transformers only
(no implementation, no measurement), so each measurement starts from the same state
without paying the imports each time.  The implementation is imported in the child.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

IMPLEMENTATIONS = ("bigmodel", "accelerate")


class _Accelerate:
    """accelerate's public names, looked up in ``accelerate`` then ``accelerate.utils``."""

    def __init__(self) -> None:
        self._modules = [importlib.import_module("accelerate"), importlib.import_module("accelerate.utils")]

    def __getattr__(self, name: str) -> Any:
        for module in self._modules:
            if hasattr(module, name):
                return getattr(module, name)
        raise AttributeError(f"accelerate has no public name {name!r}")


def load_library(impl: str) -> Any:
    """The library module for ``impl``: ``bigmodel`` itself, or accelerate's names."""
    if impl == "bigmodel":
        return importlib.import_module("bigmodel")
    if impl == "accelerate":
        return _Accelerate()
    raise ValueError(f"unknown implementation {impl!r}; use one of {IMPLEMENTATIONS} or 'floor'")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _redirect(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def child_main(case_name: str, impl: str, params: dict[str, Any], conn, log_path: str) -> None:
    """Run one case for ``impl`` ("bigmodel", "accelerate", "floor" or "fixture") and send the result.

    Sends ``{"ok": True, "metrics": {...}}`` or ``{"ok": False, "error": "<one line>"}``.
    """
    _redirect(log_path)
    try:
        if impl == "fixture":
            from . import fixtures

            result = getattr(fixtures, case_name)(**params)
        else:
            from .cases import CASES

            case = CASES[case_name]
            if impl == "floor":
                result = case.floor(params)
            else:
                result = case.run(load_library(impl), params)
        conn.send({"ok": True, "metrics": result})
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one table cell
        traceback.print_exc()
        conn.send({"ok": False, "error": _one_line(exc)})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        conn.close()
