"""Plain-text tables and human-readable sizes for the CLI."""

from __future__ import annotations

from collections.abc import Sequence


def human_bytes(nbytes: float | None) -> str:
    """``1536`` → ``"1.50 KiB"``; None → ``"-"`` (powers of 2, as memory is sized)."""
    if nbytes is None:
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned text table; columns after the first are right-aligned when they hold numbers."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [i > 0 and all(_looks_numeric(row[i]) for row in cells[1:]) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(row) for row in cells[1:]])


def _looks_numeric(text: str) -> bool:
    head = text.split(" ")[0].replace(",", "").replace(".", "")
    return head.isdigit() or text == "-"


def key_values(pairs: Sequence[tuple[str, object]]) -> str:
    """``name  value`` lines with the names padded to one width."""
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in pairs)
