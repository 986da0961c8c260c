"""What a case is: one function of the library module, a floor, and the rows it reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Metrics = dict[str, float]


@dataclass(frozen=True)
class Metric:
    """One table row of a case.

    Attributes:
        key: key of the value in the metrics dict a child returns.
        label: what the row shows, with its unit.
        budget: a fixed value (same unit) shown in the floor column instead of a measured floor.
        higher_is_better: True for rates (tokens/s).
        fmt: format of the values.
    """

    key: str
    label: str
    budget: float | None = None
    higher_is_better: bool = False
    fmt: str = "{:.3f}"


@dataclass(frozen=True)
class Case:
    """A benchmark case: ``run(lib, params)`` for each library, ``floor(params)`` for the floor.

    ``params`` hold fixture paths and named device maps; the runner turns a named map
    ("half_disk", "budget_600mb", "smollm2_half_disk") into the concrete dict.
    """

    name: str
    title: str
    run: Callable[[Any, dict[str, Any]], Metrics]
    floor: Callable[[dict[str, Any]], Metrics] | None
    metrics: tuple[Metric, ...]
    params: dict[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # fixtures: "llama", "smollm2"
    warm_files: str | None = None  # fixture whose files are read into the page cache first
    quick: bool = True
    timeout_s: float = 300.0
