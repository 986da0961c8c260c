"""Every callable bigmodel mirrors on one of accelerate's import paths takes accelerate 1.15's
parameters: the same names in the same order with the same defaults (bigmodel may add more after
them).  Code that calls by keyword (``save_offload_index(index, offload_folder=...)``) depends on it.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("accelerate")

MIRRORED_PATHS = ["", ".big_modeling", ".hooks", ".utils", ".utils.modeling", ".utils.offload",
                  ".utils.constants", ".utils.other", ".utils.memory", ".utils.operations"]  # fmt: skip

KNOWN: dict[str, str] = {}  # key "path:name" → reason, for a strict xfail of a known difference


def _signature(obj: object) -> inspect.Signature | None:
    try:
        return inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)  # type: ignore[misc]
    except (TypeError, ValueError):
        return None


def _cases() -> list[object]:
    cases, seen = [], set()
    for path in MIRRORED_PATHS:
        ours, theirs = importlib.import_module("bigmodel" + path), importlib.import_module("accelerate" + path)
        for name in getattr(ours, "__all__", None) or [n for n in dir(ours) if not n.startswith("_")]:
            mine, incumbent = getattr(ours, name, None), getattr(theirs, name, None)
            if not (callable(mine) and callable(incumbent)) or (id(mine), id(incumbent)) in seen:
                continue
            seen.add((id(mine), id(incumbent)))
            key = f"{path or '.'}:{name}"
            marks = [pytest.mark.xfail(strict=True, reason=KNOWN[key])] if key in KNOWN else []
            cases.append(pytest.param(mine, incumbent, id=key, marks=marks))
    return cases


@pytest.mark.parametrize(("mine", "incumbent"), _cases())
def test_parameters_match_accelerate(mine: object, incumbent: object) -> None:
    theirs, ours = _signature(incumbent), _signature(mine)
    if theirs is None or ours is None:
        pytest.skip("no introspectable signature")
    variadic = {inspect.Parameter.VAR_KEYWORD}
    want = [(p.name, repr(p.default)) for p in theirs.parameters.values() if p.kind not in variadic]
    have = [(p.name, repr(p.default)) for p in ours.parameters.values() if p.kind not in variadic]
    takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in ours.parameters.values())
    assert have[: len(want)] == want or (takes_kwargs and have == want[: len(have)]), (theirs, ours)
