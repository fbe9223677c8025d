"""Plain-text tables, as the command line prints them (batch summaries, journal stats)."""

from __future__ import annotations

from collections.abc import Iterable

from sandbx_pool.outcome import Status


def status_order(present: Iterable[str]) -> list[str]:
    """The statuses that occur, in the contract's order, then any unknown ones sorted."""
    seen = set(present)
    known = [status.value for status in Status if status.value in seen]
    return known + sorted(seen - set(known))


def text_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Lines of a table: the first column left-aligned, the others (numbers) right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join([first, *rest]).rstrip()

    return [line(header), *(line(row) for row in rows)]
