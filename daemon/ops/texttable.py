"""Plain-text tables for the command line (status, journal tools, demo)."""

from __future__ import annotations

from collections.abc import Sequence


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    *,
    indent: str = "",
    right: int | None = None,
) -> str:
    """Columns padded to their widest cell, a dashed rule under the header.

    Columns from index ``right`` on are right-aligned (numbers); by default
    every column is left-aligned.
    """
    cells = [list(map(str, header)), *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if right is not None and i >= right else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    lines = [line(cells[0]), "  ".join("-" * w for w in widths), *map(line, cells[1:])]
    return "\n".join(indent + text for text in lines)
