"""Tables for benchmark output: plain text for the terminal, Markdown for result files."""

from __future__ import annotations

import re
from collections.abc import Sequence

_NUMERIC = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(%|x|ms|s|B|KiB|MiB|GiB)?$", re.IGNORECASE)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns whose every cell is a number are right-aligned; text columns are left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [bool(rows) and all(_NUMERIC.match(row[i]) for row in cells[1:]) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            (cell.rjust(w) if right else cell.ljust(w)) for cell, w, right in zip(row, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table (header, rule, one line per row)."""
    lines = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
