"""`trainctl workflow`: check workflow documents here, before a run is made of one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from cli.common import EXIT_BAD_INPUT, JsonOpt, console, err_console, load_workflow
from cli.data import plan_table

workflow_app = typer.Typer(help="Check workflow documents.", no_args_is_help=True)


@workflow_app.command("validate")
def workflow_validate(
    path: Annotated[Path, typer.Argument(help="Workflow JSON file.")],
    as_json: JsonOpt = False,
) -> None:
    """Validate a workflow locally and print its plan; every problem is listed at once."""
    from contracts.workflow import WorkflowInvalid, plan
    from runtime.path import validate_workflow_with_files

    try:
        result = plan(validate_workflow_with_files(load_workflow(path)))
    except WorkflowInvalid as err:
        for problem in err.problems:
            err_console.print(f"[red]{path}[/red] {problem.path}: {problem.message}")
        raise typer.Exit(EXIT_BAD_INPUT) from err
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    console.print(plan_table(path.name, result))
