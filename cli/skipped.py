"""What an eval set skipped, as the CLI shows it (`runs eval`, `eval`, `data inspect`): the
records scored and skipped, the count marked when it is more than a few percent of the set's
records (contracts.reports.SKIPPED_MARK_SHARE), why, and the first records skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.table import Table

from contracts.reports import SKIP_REASONS, SKIPPED_MARK_SHARE, skipped_share

MARK = "!"
LEGEND = f"{MARK}: more than {SKIPPED_MARK_SHARE:.0%} of the set's records skipped"


def marked(records: int, oversized: int, skipped: Mapping[str, int]) -> bool:
    """Whether a set skipped more than SKIPPED_MARK_SHARE of its records."""
    return skipped_share(records, oversized, skipped) > SKIPPED_MARK_SHARE


def reasons(oversized: int, skipped: Mapping[str, int]) -> str:
    """ "1 too long, 2 malformed JSON", in SKIP_REASONS' order (unknown reasons last)."""
    counts = [f"{oversized:,} too long"] if oversized else []
    order = [*SKIP_REASONS, *sorted(set(skipped) - set(SKIP_REASONS))]
    counts += [f"{skipped[r]:,} {SKIP_REASONS.get(r, r)}" for r in order if skipped.get(r)]
    return ", ".join(counts)


def records_columns(title: str | None = None) -> Table:
    """A table whose rows are a set's name and its `skipped_cells`."""
    table = Table(title=title, box=None, pad_edge=False)
    table.add_column("set", no_wrap=True)
    table.add_column("scored", justify="right", no_wrap=True)
    table.add_column("skipped", justify="right", no_wrap=True)
    table.add_column("why")
    return table


def skipped_cells(records: int, oversized: int, skipped: Mapping[str, int]) -> tuple[str, ...]:
    """(scored, skipped with its mark, why) of a set."""
    count = oversized + sum(skipped.values())
    mark = f" {MARK}" if marked(records, oversized, skipped) else ""
    return f"{records:,}", f"{count:,}{mark}", reasons(oversized, skipped) or "-"


def notes(
    sets: Iterable[tuple[str, Mapping[str, Any], Sequence[str]]], *, why: bool = False
) -> list[str]:
    """Below a table of `sets` ((name, result, examples), a result's records,
    oversized_records and skipped_records): what the mark means, when a set has it, and the
    first records each set skipped; with `why`, also why each set skipped (a table without a
    why column)."""
    lines: list[str] = []
    mark = False
    for name, result, examples in sets:
        records, oversized = result["records"], result["oversized_records"]
        skipped = result.get("skipped_records") or {}
        mark = mark or marked(records, oversized, skipped)
        said = reasons(oversized, skipped)
        if said and why:
            lines.append(f"{name} skipped {said}" + (", the first:" if examples else ""))
        elif examples:
            lines.append(f"{name}, the first skipped:")
        lines += [f"  {example}" for example in examples]
    return [LEGEND, *lines] if mark else lines
