"""`trainctl`: launchers (`up`, `serve`, `worker`, `demo`), the API client commands and local
tools. Exit codes: 0 success, 1 the thing asked for failed (a run failed, a check did not
hold), 2 bad input, 3 the service could not be reached or answered an error.

This module only assembles the command; each command group is a module of its own, named
after it (`trainctl runs` is cli/runs.py), and the launchers are cli/launcher.py.
"""

from __future__ import annotations

import os

import typer

from cli.data import data_app
from cli.eval import eval_checkpoint
from cli.launcher import demo, serve, up, worker
from cli.runs import runs_app
from cli.tokens import tokens_app
from cli.workers import queue_list, workers_list
from cli.workflow import workflow_app

app = typer.Typer(help="Run and watch multi-phase LLM training workflows.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")
app.add_typer(tokens_app, name="tokens")
app.add_typer(workflow_app, name="workflow")
app.add_typer(data_app, name="data")
app.command("eval")(eval_checkpoint)
app.command()(serve)
app.command()(worker)
app.command()(up)
app.command()(demo)
app.command("workers")(workers_list)
app.command("queue")(queue_list)


def main() -> None:  # pragma: no cover - the console script entry point
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()
