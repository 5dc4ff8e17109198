"""Rows of numbers as aligned text, the way benchmarks print them and notebooks show them.

Example:
    >>> print(format_table(["policy", "C"], [["full", "-"], ["random", 128]]))
    policy    C
    ------  ---
    full      -
    random  128
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def format_table(headers: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """Rows under headers as text columns: the first left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
