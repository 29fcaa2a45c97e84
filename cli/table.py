"""Tables that fit the terminal: a number is printed whole, or its column not at all.

Given a table wider than the terminal (80 columns in a pipe or a small window), rich narrows
every column alike and cuts numbers ("3.4…") or wraps their digits. `FittedTable` decides at
render time, for the width it is given, in this order:

0. leave out a droppable column with nothing in it (a task column blank where each task
   only repeats its set's name);
1. drop the columns that go first (`Column.drop` below SHORTEN: a task column that only
   repeats its set's name);
2. wrap the headers of whole columns over their numbers, then shorten text columns with an
   ellipsis, widest first, down to their `min_width`;
3. drop the other droppable columns, lowest `drop` first, lengthening text again as room
   comes back;
4. when the whole columns still do not fit, split them over two tables (or more), of even
   size, each repeating the first `repeat` columns (a row's name).

Numbers and ids are `whole`: never shortened, never wrapped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

# Columns whose `drop` is below this go before any text is shortened; the others after.
SHORTEN = 10


@dataclass(frozen=True)
class Column:
    header: str
    justify: Literal["left", "right"] = "left"
    # Never cut: a number or an id is printed whole or its column dropped.
    whole: bool = False
    # A text column may be shortened to this many cells (its header's length at least).
    min_width: int = 8
    # The order columns are dropped in when the table does not fit (lowest first; below
    # SHORTEN before any text is shortened); None: never dropped.
    drop: int | None = None


def number(header: str, *, drop: int | None = None) -> Column:
    """A right-aligned column of numbers, never cut."""
    return Column(header, justify="right", whole=True, drop=drop)


def text(header: str, *, min_width: int = 8, drop: int | None = None) -> Column:
    return Column(header, min_width=min_width, drop=drop)


Cell = str | Text

# What a table costs beside its cells: no box, a padding of one cell on each side of a
# column but the table's outer edges.
_PADDING = 2


def _chrome(columns: int) -> int:
    return _PADDING * columns - _PADDING if columns else 0


def _length(cell: Cell) -> int:
    return cell.cell_len if isinstance(cell, Text) else cell_len(cell)


class FittedTable:
    """A table of `columns` and `rows` (cells as plain strings, never markup, or rich Text)
    that fits the width it is rendered at (see the module docstring)."""

    def __init__(
        self,
        columns: Sequence[Column],
        rows: Sequence[Sequence[Cell]],
        *,
        title: str | None = None,
        repeat: int = 0,
    ) -> None:
        if any(len(row) != len(columns) for row in rows):
            raise ValueError("every row needs a cell per column")
        self.columns = list(columns)
        self.rows = [list(row) for row in rows]
        self.title = title
        self.repeat = repeat
        self.cells = [
            max((_length(row[i]) for row in self.rows), default=0) for i in range(len(columns))
        ]
        self.natural = [
            max(cell_len(c.header), widest)
            for c, widest in zip(self.columns, self.cells, strict=True)
        ]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        # The title on a line of its own: a table's title wraps at the table's width, and
        # the first part of a split table may be narrower than the title.
        if self.title:
            yield Text(self.title, style="italic")
        for i, table in enumerate(self.tables(options.max_width)):
            if i:
                yield Text()  # a blank line between the parts of a split table
            yield table

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        widest = sum(self.natural) + _chrome(len(self.columns))
        return Measurement(min(widest, options.max_width), min(widest, options.max_width))

    def tables(self, width: int) -> list[Table]:
        """The table(s) to print at `width` cells."""
        # A droppable column with nothing in it (a task column blank where the task is the
        # set's name) is not shown at any width.
        shown = [i for i, c in enumerate(self.columns) if self.cells[i] or c.drop is None]
        kept, widths = self._fit(shown, width)
        if widths is not None:
            return [self._table(kept, widths)]
        # Even with every droppable column gone the whole ones do not fit: split them into
        # the fewest parts of even size that fit, each after the repeated columns; with one
        # part more if that spares shortening them.
        head = [i for i in kept if i < self.repeat]
        rest = [i for i in kept if i >= self.repeat]
        shortened = self._split(head, rest, width, self._fitting)
        as_is = self._split(head, rest, width, self._fit_as_is, most=len(shortened) + 1)
        parts = as_is or shortened
        return [self._table(part, widths) for part, widths in parts]

    def _split(
        self,
        head: list[int],
        rest: list[int],
        width: int,
        fit: Callable[[list[int], int], list[int] | None],
        most: int | None = None,
    ) -> list[tuple[list[int], list[int]]]:
        """`rest` in the fewest consecutive parts of even size (at most `most`) that each
        fit beside `head` by `fit`; a column that fits nowhere beside `head` goes alone,
        at its narrowest. [] when `most` parts are too few."""
        for count in range(2, min(most or len(rest), len(rest)) + 1):
            size = -(-len(rest) // count)
            chunks = [rest[i : i + size] for i in range(0, len(rest), size)]
            found = [fit([*head, *chunk], width) for chunk in chunks]
            if all(widths is not None for widths in found):
                return [
                    ([*head, *chunk], widths)
                    for chunk, widths in zip(chunks, found, strict=True)
                    if widths is not None
                ]
        if most is not None:
            return []
        # Not even one column beside the repeated ones: each on its own.
        return [([i], fit([i], width) or self._narrowest([i])) for i in rest]

    def _fit(self, kept: list[int], width: int) -> tuple[list[int], list[int] | None]:
        """The columns kept and their widths, going through the steps of the module
        docstring until the table fits; widths None when it never does."""
        drops = sorted(
            (c.drop, i) for i, c in enumerate(self.columns) if c.drop is not None and i in kept
        )
        steps: list[int | None] = [i for rank, i in drops if rank < SHORTEN]
        steps.append(None)  # from here on text may be shortened
        steps += [i for rank, i in drops if rank >= SHORTEN]
        shorten = False
        widths = self._fit_as_is(kept, width)
        for step in steps:
            if widths is not None:
                return kept, widths
            if step is None:
                shorten = True
            else:
                kept = [i for i in kept if i != step]
            widths = self._fit_as_is(kept, width) or (
                self._shortened(kept, width) if shorten else None
            )
        return kept, widths

    def _fitting(self, kept: list[int], width: int) -> list[int] | None:
        return self._fit_as_is(kept, width) or self._shortened(kept, width)

    def _fit_as_is(self, kept: list[int], width: int) -> list[int] | None:
        widths = [self.natural[i] for i in kept]
        return widths if sum(widths) + _chrome(len(kept)) <= width else None

    def _floor(self, i: int) -> int:
        """The narrowest column `i` may be: for a whole column its widest cell or the longest
        piece of its header (which wraps after a space, "_" or "-"); for text its minimum
        width (or header)."""
        column = self.columns[i]
        if column.whole:
            pieces = re.findall(r"[^ _-]*[_-]?", column.header)
            return max(self.cells[i], *(cell_len(p) for p in pieces))
        return min(self.natural[i], max(column.min_width, cell_len(column.header)))

    def _narrowest(self, kept: list[int]) -> list[int]:
        return [self._floor(i) for i in kept]

    def _shortened(self, kept: list[int], width: int) -> list[int] | None:
        """The headers of whole columns wrapped, then text columns shortened, the widest
        first, until the table fits; None when it does not at their minimum widths."""
        widths = {i: self.natural[i] for i in kept}
        excess = sum(widths.values()) + _chrome(len(kept)) - width
        for whole in (True, False):  # a wrapped header loses nothing; shortened text does
            while excess > 0:
                shorter = [
                    i for i in kept if self.columns[i].whole == whole and widths[i] > self._floor(i)
                ]
                if not shorter:
                    break
                widest = max(shorter, key=lambda i: (widths[i] - self._floor(i), widths[i]))
                widths[widest] -= 1
                excess -= 1
        return None if excess > 0 else [widths[i] for i in kept]

    def _table(self, kept: list[int], widths: list[int]) -> Table:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for i, width in zip(kept, widths, strict=True):
            column = self.columns[i]
            # A whole column's header wraps over its numbers rather than widen it.
            header = Text(_wrap(column.header, width) if column.whole else column.header)
            table.add_column(
                header,
                justify=column.justify,
                no_wrap=True,
                overflow="ellipsis",
                width=width,
            )
        for row in self.rows:
            table.add_row(*(_as_text(row[i]) for i in kept))
        return table


def _wrap(header: str, width: int) -> str:
    """`header` in lines of at most `width` cells, broken after a space, "_" or "-" where one
    falls in a line, else inside a word."""
    pieces = re.findall(r"[^ _-]*[ _-]?", header)
    lines = [""]
    for piece in filter(None, pieces):
        if lines[-1] and cell_len(lines[-1] + piece.rstrip()) > width:
            lines.append("")
        lines[-1] += piece
        while cell_len(lines[-1].rstrip()) > width:
            lines[-1], rest = lines[-1][:width], lines[-1][width:]
            lines.append(rest)
    return "\n".join(line.rstrip() for line in lines if line.strip())


def _as_text(cell: Cell) -> Text:
    return cell if isinstance(cell, Text) else Text(cell)
