"""`trainctl runs compare` and `trainctl runs export`: what the API's comparison and CSV answers
look like in a terminal and on disk. Plain functions of the JSON answers (no side imported)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.text import Text

from cli.evaluation import perplexity, task_cell, task_column
from cli.table import SHORTEN, Column, FittedTable, number, text

# Differences shown per group before "... and K more" (`runs compare --all` shows all).
FOLD_AFTER = 5


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _value(value: Any) -> str:
    if value is None:
        return "(none)"
    return value if isinstance(value, str) else json.dumps(value)


def runs_table(comparison: dict[str, Any]) -> FittedTable:
    columns = [
        number("#"),
        Column("run", whole=True),
        text("name", min_width=10),
        text("status", min_width=9),
        number("step"),
        text("tags", min_width=8, drop=SHORTEN + 1),
        Column("signature", whole=True, drop=0),
    ]
    rows = [
        [
            str(i),
            run["id"],
            run["name"],
            run["status"],
            f"{run['step']}/{run['total_steps']}",
            ", ".join(run["tags"]) or "-",
            run["signature"][:12],
        ]
        for i, run in enumerate(comparison["runs"], start=1)
    ]
    return FittedTable(columns, rows, title="runs (the first is the reference)")


def evals_table(comparison: dict[str, Any]) -> FittedTable:
    """Eval sets by runs: a row per (set, run) with baseline, final and best perplexity, the
    change of the final against its own baseline and against the first run's final."""
    sets = comparison["evals"]
    columns = [
        text("set", min_width=10),
        task_column([(s["name"], s["task"]) for s in sets]),
        text("run", min_width=8),
        number("baseline"),
        number("final @step"),
        number("best @step"),
        number("vs baseline"),
        number("vs first"),
    ]
    names = {run["id"]: f"{i}:{run['name']}" for i, run in enumerate(comparison["runs"], 1)}
    rows = []
    for eval_set in sets:
        for i, row in enumerate(eval_set["runs"]):
            rows.append(
                [
                    eval_set["name"] if i == 0 else "",
                    task_cell(eval_set["name"], eval_set["task"]) if i == 0 else "",
                    names.get(row["run_id"], row["run_id"]),
                    perplexity(row["baseline"]),
                    perplexity(row["final"], at=True),
                    perplexity(row["best"], at=True),
                    _percent(row["final_vs_baseline"]),
                    "ref" if i == 0 else _percent(row["final_vs_first"]),
                ]
            )
    return FittedTable(
        columns, rows, title="evaluation per eval set: target-only perplexity", repeat=1
    )


class InputsView:
    """The signed inputs that differ, by group (data files, per-phase fields, optimizer,
    evals, other), each field with every run's value on a line of its own (digests and paths
    are long: a table would fold them); a group of more than `fold_after` fields shows the
    first ones and how many more (None: every one). Or a line saying the inputs are
    identical. A value is never cut: the runs' labels ("2:lower-lr") are shortened for it."""

    def __init__(self, comparison: dict[str, Any], *, fold_after: int | None = FOLD_AFTER):
        self.comparison = comparison
        self.fold_after = fold_after

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.text(options.max_width)

    def text(self, width: int) -> Text:
        inputs = self.comparison["inputs"]
        if inputs["identical"]:
            return Text(f"what differs: nothing. {inputs['summary']}")
        differences = inputs["differences"]
        # An answer from a service without groups: one group of every difference.
        groups = inputs.get("groups") or [
            {"name": "other", "title": "inputs", "summary": f"{len(differences)} fields"}
        ]
        out = Text(f"what differs: {inputs['summary']}\n")
        for group in groups:
            members = [d for d in differences if d.get("group", "other") == group["name"]]
            out.append(f"{group['title']}: {group['summary']}\n", style="bold underline")
            shown = members if self.fold_after is None else members[: self.fold_after]
            for difference in shown:
                changes = [c for c in dict.fromkeys(difference.get("changes") or []) if c]
                out.append(f"  {difference['field']}", style="bold")
                out.append(f"  {', '.join(changes)}\n" if changes else "\n", style="dim")
                labels = self._labels(width, difference["values"])
                for label, value in zip(labels, difference["values"], strict=True):
                    out.append(f"    {label}  {_value(value)}\n")
            if len(shown) < len(members):
                more = len(members) - len(shown)
                out.append(f"  ... and {more} more (--all shows every one)\n", style="dim")
        out.rstrip()
        return out

    def _labels(self, width: int, values: list[Any]) -> list[str]:
        """Each run's "i:name", all as wide, its name cut so that the longest of `values`
        fits on the line beside it."""
        runs = self.comparison["runs"]
        names = [f"{i}:{run['name']}" for i, run in enumerate(runs, start=1)]
        longest = max((len(_value(v)) for v in values), default=0)
        room = max(len(f"{len(runs)}:"), min(max(map(len, names)), width - 6 - longest))
        cut = [name if len(name) <= room else name[: room - 1] + "…" for name in names]
        return [name.ljust(room) for name in cut]


def inputs_view(comparison: dict[str, Any], *, fold_after: int | None = FOLD_AFTER) -> InputsView:
    return InputsView(comparison, fold_after=fold_after)


def comparison_view(comparison: dict[str, Any], *, fold_after: int | None = FOLD_AFTER) -> Group:
    """The eval table first (what a comparison is for), then the runs, then what differs."""
    parts: list[Any] = []
    if comparison["evals"]:
        parts.append(evals_table(comparison))
    else:
        parts.append(Text("no evaluations yet"))
    parts.append(runs_table(comparison))
    parts.append(inputs_view(comparison, fold_after=fold_after))
    return Group(*parts)


def export_paths(directory: Path) -> dict[str, Path]:
    """Where `runs export` writes: DIR/metrics.csv and DIR/evals.csv."""
    return {"metrics": directory / "metrics.csv", "evals": directory / "evals.csv"}


def count_rows(path: Path) -> int:
    """Data rows of a CSV file written by the service (its header not counted)."""
    with path.open("rb") as f:
        return max(0, sum(1 for _ in f) - 1)
