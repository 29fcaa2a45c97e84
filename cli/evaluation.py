"""How evaluations read in a terminal: the cells of an eval table (`runs eval`, `runs
compare`, the demo) and a run's evaluations phase by phase (`runs eval RUN --by-phase`, the
demo's last table). Plain functions of the API's answers (no side imported)."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.text import Text

from cli.table import SHORTEN, Column, FittedTable, number, text


def perplexity(point: dict[str, Any] | None, *, at: bool = False) -> str:
    """A point's perplexity as a table shows it ("-" when there is none, or it was not a
    finite number), with "@step" when `at`."""
    if point is None or point.get("perplexity") is None:
        return "-"
    return f"{point['perplexity']:.2f}" + (f" @{point['step']}" if at else "")


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def task_column(pairs: list[tuple[str, str]]) -> Column:
    """The task column of a table of eval sets, `pairs` (set name, task): dropped first when
    every task only repeats its set's name, else after the names are shortened."""
    redundant = all(name == task for name, task in pairs)
    return text("task", min_width=10, drop=0 if redundant else SHORTEN + 10)


def task_cell(name: str, task: str) -> str:
    """A set's task in a table beside its name: blank when it only repeats the name (a set's
    name is its task unless it was given one)."""
    return "" if task == name else task


# Marks a cell whose phase has not reached (or not evaluated) its last step.
SO_FAR = "*"


def change_text(change: float | None) -> str:
    """A change in percent, one decimal below 10%: "+60%", "-99%", "+0.4%"."""
    if change is None:
        return ""
    return f"{change:+.1f}%" if abs(change) < 10 else f"{change:+.0f}%"


def matrix_cell(cell: dict[str, Any]) -> Text:
    """A phase's end value of one set and its change over the phase, green when the
    perplexity fell, red when it rose (forgetting); "-" before the phase's first evaluation."""
    end = cell["end"]
    if end is None or end.get("perplexity") is None:
        return Text("-")
    change = cell["change"]
    style = "" if change is None or change == 0 else ("green" if change < 0 else "red")
    out = Text(f"{end['perplexity']:.2f}")
    if change is not None:
        out.append(" ")
        out.append(change_text(change), style=style)
    if not cell["complete"]:
        out.append(SO_FAR)
    return out


def phase_label(phase: dict[str, Any]) -> str:
    return f"{phase['name']} (replay)" if phase.get("role") == "replay" else phase["name"]


def phase_matrix(answer: dict[str, Any]) -> Group:
    """`GET /runs/{id}/eval/phases` as a table: a row per phase (the baseline first), a column
    per eval set, each cell the set's perplexity at the phase's end and its change over the
    phase. When the sets do not fit the width, they continue in a second table."""
    sets = answer["sets"]
    if not sets:
        return Group(Text("no evaluations yet"))
    columns = [text("phase", min_width=16), *(number(s["name"]) for s in sets)]
    baseline: list[str | Text] = ["baseline"]
    baseline += [
        f"{s['baseline']['perplexity']:.2f}"
        if s["baseline"] and s["baseline"]["perplexity"] is not None
        else "-"
        for s in sets
    ]
    rows: list[list[str | Text]] = [baseline]
    for phase in answer["phases"]:
        rows.append([phase_label(phase), *(matrix_cell(cell) for cell in phase["sets"])])
    table = FittedTable(
        columns,
        rows,
        title="perplexity at each phase's end, and its change over the phase",
        repeat=1,
    )
    notes = []
    if any(not c["complete"] and c["end"] for p in answer["phases"] for c in p["sets"]):
        notes.append(f"{SO_FAR} so far: the phase has not evaluated its last step yet")
    return Group(table, *(Text(note, style="dim") for note in notes))
