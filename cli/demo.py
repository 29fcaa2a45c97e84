"""`trainctl demo`: the whole product in one command on the embedded stack."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from cli.evaluation import percent, perplexity, phase_matrix, task_cell, task_column
from cli.skipped import notes, records_columns, skipped_cells
from cli.stack import free_port, spawn, stop, wait_healthy
from cli.table import FittedTable, number, text
from cli.watch import watch
from client import Client
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


def data_folder(*workflows: dict[str, Any]) -> str:
    """The folder holding every file the (resolved) workflows name: the demo stack's data root,
    wherever `trainctl demo` is started from."""
    folders = [os.path.dirname(value) for w in workflows for _, value, _ in path_fields(w)]
    return os.path.commonpath(folders) if folders else os.getcwd()


def needs_start(workflow: dict[str, Any]) -> bool:
    """Whether a workflow is post-training only: no pretrained model, and a first phase that is
    not pretraining (a supervised phase, or replay). From random weights it would measure
    nothing, so the demo starts it from the demo run's final checkpoint. A document too
    malformed to tell is left to the service to refuse."""
    model, phases = workflow.get("model"), workflow.get("phases")
    if not isinstance(model, dict) or not isinstance(phases, list) or not phases:
        return False
    first = phases[0]
    if model.get("pretrained") or not isinstance(first, dict):
        return False
    return not (
        first.get("objective") == "continued_pretrain" and first.get("role", "train") == "train"
    )


def fits_start(workflow: dict[str, Any], start: dict[str, Any]) -> bool:
    """Whether `start`'s checkpoints can start `workflow`: the same model and tokenizer."""
    return (workflow.get("model"), workflow.get("tokenizer")) == (
        start["model"],
        start["tokenizer"],
    )


def name_of(workflow: dict[str, Any]) -> str:
    """The workflow's name for its run; "demo" for a document without one, which the service
    then refuses for that reason."""
    name = workflow.get("name")
    return name if isinstance(name, str) and name else "demo"


@dataclass(frozen=True)
class DemoResult:
    """What `run_demo` did: the run (its public view at its end) and its evaluation, the run
    whose final checkpoint it started from (None when it trained from its own start), and
    whether every check passed."""

    ok: bool
    run: dict[str, Any]
    evals: dict[str, Any] | None = None
    start: dict[str, Any] | None = None


def finished_start(api: Client, start: dict[str, Any]) -> dict[str, Any] | None:
    """The newest run of `start` in this home that succeeded and kept a checkpoint: an earlier
    `trainctl demo` trained it already, and runs are deterministic."""
    workflow_id = api.create_workflow(start).id
    page = api.list_runs(status="succeeded", name=start["name"], limit=50)
    for run in page.runs:
        if run.workflow_id == workflow_id and run.latest_checkpoint:
            return api.get_run(run.id).model_dump(mode="json")
    return None


def train(api: Client, workflow: dict[str, Any], *, timeout: float, **body: Any) -> dict[str, Any]:
    """Create a run of `workflow` named after it, watch it to its end; its public view."""
    run = api.create_run(workflow, name=name_of(workflow), **body)
    phases = len(run.plan.phases)
    console.print(f"run [bold]{run.id}[/bold]: {run.total_steps} steps, {phases} phases")
    watch(api, run.id, timeout=timeout, console=console, poll=0.5)
    done = api.get_run(run.id).model_dump(mode="json")
    if done["status"] != "succeeded":
        console.print(
            f"[red]run {done['status']}[/red]: {done.get('cause')}: {done.get('message')}"
        )
    return done


def start_of(api: Client, start: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """A succeeded run of `start` to take the final checkpoint of: this home's, or trained now."""
    run = finished_start(api, start)
    if run is not None:
        console.print(f"{start['name']} succeeded in this home before: run {run['id']}")
        return run
    console.print(f"no run of {start['name']} in this home: training it first")
    return train(api, start, timeout=timeout)


def run_demo(
    workflow: dict[str, Any],
    *,
    home: Path,
    timeout: float,
    start: dict[str, Any] | None = None,
) -> DemoResult:
    """Run `workflow` on a fresh embedded stack in `home`: from the final checkpoint of a
    succeeded run of `start` when given (trained first when this home has none), else from its
    own start. Prints the loss per phase and the evaluation against the baseline."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "demo-stack.log"
    console.print(f"starting the embedded stack on {url} (home {home}, log {log})")
    roots = data_folder(workflow, *([] if start is None else [start]))
    stack = spawn(
        ["up", "--port", str(port), "--workers", "1"],
        env={"TRAINCTL_HOME": str(home), ROOTS_VARIABLE: roots},
        log=log,
    )
    try:
        wait_healthy(url, timeout=120, process=stack)
        token = (home / "token").read_text().strip()
        with Client(url, token) as api:
            body: dict[str, Any] = {}
            first = None
            if start is not None:
                first = start_of(api, start, timeout=timeout)
                if first["status"] != "succeeded":
                    return DemoResult(ok=False, run=first)
                final = first["latest_checkpoint"]
                console.print(
                    f"starting {name_of(workflow)} from run {first['id']}'s final checkpoint, "
                    f"step {final['step']} ({final['path']})",
                    soft_wrap=True,
                )
                body["initial_checkpoint"] = {"run": first["id"], "step": final["step"]}
            started = time.monotonic()
            run = train(api, workflow, timeout=timeout, **body)
            elapsed = time.monotonic() - started
            if run["status"] != "succeeded":
                return DemoResult(ok=False, run=run, start=first)
            evals = api.eval(run["id"]).model_dump(mode="json")
            by_phase = api.eval_by_phase(run["id"]).model_dump(mode="json")
            metrics = api.metrics(run["id"], names=["loss"]).model_dump(mode="json")
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

    problems = demo_problems(phase_losses, evals)
    for problem in problems:
        console.print(f"[red]check failed:[/red] {problem}")
    return DemoResult(ok=not problems, run=run, evals=evals, start=first)


def demo_problems(phase_losses: list[tuple[str, float, float]], evals: dict[str, Any]) -> list[str]:
    """What makes the demo fail: a phase whose loss did not fall, an eval set whose final
    perplexity does not beat its baseline (or that has no perplexity to compare: every
    record skipped)."""
    problems = [
        f"loss did not fall in phase {n} ({a:.3f} -> {b:.3f})" for n, a, b in phase_losses if b >= a
    ]
    for name, summary in evals["tasks"].items():
        base = (summary.get("baseline") or {}).get("perplexity")
        latest = (summary.get("latest") or {}).get("perplexity")
        if base is None or latest is None:
            problems.append(f"eval set {name}: no perplexity to compare (no record scored)")
        elif latest >= base:
            problems.append(f"eval set {name}: final perplexity does not beat the baseline")
    return problems
