"""`trainctl demo`: the whole product in one command on the embedded stack."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cli.client import ApiClient
from cli.evaluation import percent, perplexity, phase_matrix, task_cell, task_column
from cli.skipped import notes, records_columns, skipped_cells
from cli.stack import free_port, spawn, stop, wait_healthy
from cli.table import FittedTable, number, text
from cli.watch import watch
from contracts.paths import ROOTS_VARIABLE
from contracts.workflow import path_fields

console = Console()


def eval_table(answer: dict[str, Any]) -> FittedTable:
    """`GET /runs/{id}/eval` as a table: one row per eval set (by name), with its task."""
    sets = sorted(answer["tasks"].items())
    columns = [
        text("set", min_width=12),
        task_column([(name, summary.get("task", name)) for name, summary in sets]),
        number("baseline"),
        number("final @step"),
        number("best @step"),
        number("change"),
    ]
    rows = []
    for name, summary in sets:
        base, latest = summary.get("baseline"), summary["latest"]
        change = None
        if base and base.get("perplexity") and latest.get("perplexity") is not None:
            change = latest["perplexity"] / base["perplexity"] - 1
        rows.append(
            [
                name,
                task_cell(name, summary.get("task", name)),
                perplexity(base),
                perplexity(latest, at=True),
                perplexity(summary.get("best"), at=True),
                percent(change),
            ]
        )
    return FittedTable(
        columns, rows, title="evaluation per eval set: target-only perplexity", repeat=1
    )


def records_table(answer: dict[str, Any]) -> Table:
    """Beside `eval_table`: per eval set, the records its latest evaluation scored and skipped,
    and why (cli/skipped.py)."""
    table = records_columns("records per eval set, latest evaluation")
    for name, summary in sorted(answer["tasks"].items()):
        latest = summary["latest"]
        skipped = latest.get("skipped_records", {})  # none from a service before them
        table.add_row(name, *skipped_cells(latest["records"], latest["oversized_records"], skipped))
    return table


def skipped_notes(answer: dict[str, Any]) -> list[str]:
    """Below `records_table`: what its mark means, and the first records each set skipped."""
    sets = sorted(answer["tasks"].items())
    return notes(
        (name, summary["latest"], summary.get("skipped_examples", [])) for name, summary in sets
    )


def loss_by_phase(metrics: dict[str, Any], plan: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(phase, first loss, last loss) from the run's loss series."""
    steps, values = metrics["loss"]["steps"], metrics["loss"]["values"]
    out = []
    for phase in plan["phases"]:
        points = [
            v
            for s, v in zip(steps, values, strict=True)
            if phase["first_step"] <= s <= phase["last_step"]
        ]
        if points:
            out.append((phase["name"], points[0], points[-1]))
    return out


def loss_table(phase_losses: list[tuple[str, float, float]]) -> FittedTable:
    rows = [[name, f"{first:.3f}", f"{last:.3f}"] for name, first, last in phase_losses]
    columns = [text("phase", min_width=12), number("first"), number("last")]
    return FittedTable(columns, rows, title="training loss per phase")


def data_folder(workflow: dict[str, Any]) -> str:
    """The folder holding every file the (resolved) workflow names: the demo stack's data root,
    wherever `trainctl demo` is started from."""
    folders = [os.path.dirname(value) for _, value, _ in path_fields(workflow)]
    return os.path.commonpath(folders) if folders else os.getcwd()


def run_demo(workflow: dict[str, Any], *, home: Path, timeout: float) -> bool:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "demo-stack.log"
    console.print(f"starting the embedded stack on {url} (home {home}, log {log})")
    stack = spawn(
        ["up", "--port", str(port), "--workers", "1"],
        env={"TRAINCTL_HOME": str(home), ROOTS_VARIABLE: data_folder(workflow)},
        log=log,
    )
    try:
        wait_healthy(url, timeout=120, process=stack)
        token = (home / "token").read_text().strip()
        with ApiClient(url, token) as api:
            run = api.post("/runs", json={"workflow": workflow, "name": "demo"})
            phases = len(run["plan"]["phases"])
            console.print(
                f"run [bold]{run['id']}[/bold]: {run['total_steps']} steps, {phases} phases"
            )
            started = time.monotonic()
            watch(api, run["id"], timeout=timeout, console=console, poll=0.5)
            run = api.get(f"/runs/{run['id']}")
            elapsed = time.monotonic() - started
            if run["status"] != "succeeded":
                console.print(
                    f"[red]run {run['status']}[/red]: {run.get('cause')}: {run.get('message')}"
                )
                return False
            evals = api.get(f"/runs/{run['id']}/eval")
            by_phase = api.get(f"/runs/{run['id']}/eval/phases")
            metrics = api.get(f"/runs/{run['id']}/metrics", params={"names": "loss"})
    finally:
        stop(stack)

    console.print(f"run succeeded in {elapsed:.0f} s")
    phase_losses = loss_by_phase(metrics, run["plan"])
    console.print(loss_table(phase_losses))
    console.print(eval_table(evals))
    console.print(phase_matrix(by_phase))
    console.print(records_table(evals))
    for line in skipped_notes(evals):
        console.print(line, soft_wrap=True, markup=False, highlight=False)

    problems = [
        f"loss did not fall in phase {n} ({a:.3f} -> {b:.3f})" for n, a, b in phase_losses if b >= a
    ]
    for name, summary in evals["tasks"].items():
        base, latest = summary.get("baseline"), summary["latest"]
        if base is None or latest["perplexity"] >= base["perplexity"]:
            problems.append(f"eval set {name}: final perplexity does not beat the baseline")
    for problem in problems:
        console.print(f"[red]check failed:[/red] {problem}")
    return not problems
