"""`trainctl workflow`: check workflow documents here, before a run is made of one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from cli.common import JsonOpt, console, load_workflow, refuse_workflow

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
        raise refuse_workflow(path, err) from err
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    console.print(plan_table(path.name, result))


def token_count(count: int) -> str:
    """842137600 -> '842M', 36044800 -> '36.0M', 5120 -> '5.12k': three significant digits."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.{2 if value < 10 else 1 if value < 100 else 0}f}{unit}"
    return str(count)


def plan_table(title: str, plan: Any) -> Table:
    """The plan of a workflow, within 80 columns: per phase (with its source's geometry), the
    sources of a mixture, and replay as a share of all compute tokens and of post-training
    tokens (contracts.workflow.Plan has the definitions and the exact counts)."""
    table = Table(
        title=f"{title}: {plan.total_steps:,} steps, {plan.compute_tokens:,} tokens",
        box=None,
        pad_edge=False,
        caption_justify="left",
    )
    table.caption = (
        f"replay {plan.replay_tokens:,} tokens: {plan.replay_token_share:.1%} of all tokens, "
        f"{plan.post_training_replay_share:.1%} of {plan.post_training_tokens:,} post-training "
        "tokens (supervised and replay phases). share: a phase's of the run's tokens, a "
        "source's of its phase's; replay: of the phase's tokens"
    )
    table.add_column("phase / source")
    table.add_column("objective", no_wrap=True)
    for column in ("steps", "tokens", "share", "replay"):
        table.add_column(column, justify="right", no_wrap=True)
    for p in plan.phases:
        mixture = len(p.sources) > 1
        geometry = (
            "" if mixture else f" {p.sources[0].sequence_length}x{p.sources[0].microbatch_size}"
        )
        table.add_row(
            f"[bold]{p.name}[/bold]{geometry}{' (replay)' if p.role == 'replay' else ''}",
            p.objective,
            f"{p.first_step}-{p.last_step}",
            token_count(p.compute_tokens),
            f"{p.token_share:.1%}",
            f"{p.replay_token_share:.1%}" if p.replay_token_share else "",
        )
        for s in p.sources if mixture else []:
            table.add_row(
                f"  {s.name} {s.sequence_length}x{s.microbatch_size}",
                s.objective,
                "",
                token_count(s.compute_tokens),
                f"{s.token_share:.1%}",
                "",
            )
    return table
