"""`trainctl runs compare` and `trainctl runs export`: what the API's comparison and CSV answers
look like in a terminal and on disk. Plain functions of the JSON answers (no side imported)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _at(point: dict[str, Any] | None) -> str:
    if point is None or point.get("perplexity") is None:
        return "-"
    return f"{point['perplexity']:.3f} @{point['step']}"


def _value(value: Any) -> str:
    if value is None:
        return "(none)"
    return value if isinstance(value, str) else json.dumps(value)


def runs_table(comparison: dict[str, Any]) -> Table:
    table = Table(title="runs (the first is the reference)")
    for column in ("#", "run", "name", "status", "step", "tags", "signature"):
        table.add_column(column, no_wrap=column != "tags")
    for i, run in enumerate(comparison["runs"], start=1):
        table.add_row(
            str(i),
            run["id"],
            run["name"],
            run["status"],
            f"{run['step']}/{run['total_steps']}",
            ", ".join(run["tags"]) or "-",
            run["signature"][:12],
        )
    return table


def evals_table(comparison: dict[str, Any]) -> Table:
    """Eval sets by runs: a row per (set, run) with baseline, final and best perplexity, the
    change of the final against its own baseline and against the first run's final."""
    table = Table(title="evaluation per eval set: target-only perplexity")
    table.add_column("set", no_wrap=True)
    table.add_column("task", no_wrap=True)
    table.add_column("run", no_wrap=True)
    for column in ("baseline", "final @step", "best @step", "vs baseline", "vs first"):
        table.add_column(column, justify="right", no_wrap=True)
    names = {run["id"]: f"{i}:{run['name']}" for i, run in enumerate(comparison["runs"], 1)}
    for eval_set in comparison["evals"]:
        for i, row in enumerate(eval_set["runs"]):
            table.add_row(
                eval_set["name"] if i == 0 else "",
                eval_set["task"] if i == 0 else "",
                names.get(row["run_id"], row["run_id"]),
                _at(row["baseline"]),
                _at(row["final"]),
                _at(row["best"]),
                _percent(row["final_vs_baseline"]),
                "ref" if i == 0 else _percent(row["final_vs_first"]),
            )
    return table


def inputs_view(comparison: dict[str, Any]) -> Text:
    """The signed inputs that differ, each field with every run's value on a line of its own
    (digests and paths are long: a table would fold them); or a line saying the inputs are
    identical."""
    inputs = comparison["inputs"]
    if inputs["identical"]:
        return Text(f"what differs: nothing. {inputs['summary']}")
    names = [f"{i}:{run['name']}" for i, run in enumerate(comparison["runs"], start=1)]
    width = max(len(name) for name in names)
    text = Text(f"what differs: {inputs['summary']}\n")
    for difference in inputs["differences"]:
        text.append(f"  {difference['field']}\n", style="bold")
        for name, value in zip(names, difference["values"], strict=True):
            text.append(f"    {name.ljust(width)}  {_value(value)}\n")
    text.rstrip()
    return text


def comparison_view(comparison: dict[str, Any]) -> Group:
    parts: list[Any] = [runs_table(comparison)]
    if comparison["evals"]:
        parts.append(evals_table(comparison))
    else:
        parts.append(Text("no evaluations yet"))
    parts.append(inputs_view(comparison))
    return Group(*parts)


def export_paths(directory: Path) -> dict[str, Path]:
    """Where `runs export` writes: DIR/metrics.csv and DIR/evals.csv."""
    return {"metrics": directory / "metrics.csv", "evals": directory / "evals.csv"}


def count_rows(path: Path) -> int:
    """Data rows of a CSV file written by the service (its header not counted)."""
    with path.open("rb") as f:
        return max(0, sum(1 for _ in f) - 1)
