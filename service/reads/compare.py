"""Comparing runs (`GET /runs/compare`): their eval sets side by side and what differs in their
inputs.

Reads stay bounded: per (run, eval set) the database answers at most three rows (the baseline,
the final and the best evaluation, picked by window functions), and the input diff comes from
the signature components stored with each run, the same explanation a refused resume gives
(contracts.signature.diff_components). Curves are not read here: a client draws them from
each run's thinned `GET /runs/{id}/metrics` and `GET /runs/{id}/eval`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from contracts.api import (
    ComparedEval,
    ComparedEvalSet,
    ComparedPhase,
    ComparedRun,
    EvalAt,
    InputDiff,
    InputDifference,
    InputGroup,
    RunComparison,
)
from contracts.signature import diff_components
from contracts.workflow import Plan
from service.lifecycle import RunStatus
from service.models import EvalResult, Run
from service.reads.series import json_float
from service.runs.view import run_tags


def percent_change(value: float | None, reference: float | None) -> float | None:
    """100 * (value - reference) / reference; None when either is missing or reference is 0."""
    if value is None or reference is None or reference == 0:
        return None
    return 100.0 * (value - reference) / reference


# What differs, grouped, in the order a comparison shows the groups: (name, title).
INPUT_GROUPS = (
    ("data", "data files"),
    ("phases", "per-phase fields"),
    ("optimizer", "optimizer"),
    ("evals", "evals"),
    ("other", "other inputs"),
)
_GROUP_ORDER = {name: i for i, (name, _) in enumerate(INPUT_GROUPS)}


def input_group(field: str) -> str:
    """The group (INPUT_GROUPS) of a field as diff_components names it."""
    for prefix, group in (
        ('data["', "data"),
        ("phases[", "phases"),
        ("optimizer.", "optimizer"),
        ("evals[", "evals"),
    ):
        if field.startswith(prefix):
            return group
    return "other"


def change_of(value: Any, reference: Any) -> str | None:
    """A run's value of an input against the first run's: added, removed, changed or None."""
    if value == reference:
        return None
    if reference is None:
        return "added"
    return "removed" if value is None else "changed"


def input_differences(components: Sequence[dict[str, Any]]) -> list[InputDifference]:
    """Every signed input in which a run differs from the first, with each run's value: the
    union over runs of diff_components(first, run), a field's value for a run that does not
    differ in it being the first run's. By group (INPUT_GROUPS), then field."""
    first = components[0] if components else {}
    diffs = [{d.field: d for d in diff_components(first, other)} for other in components[1:]]
    fields = sorted(
        {name for diff in diffs for name in diff}, key=lambda f: (_GROUP_ORDER[input_group(f)], f)
    )
    out = []
    for name in fields:
        reference = next(diff[name].stored for diff in diffs if name in diff)
        values = [reference] + [diff[name].given if name in diff else reference for diff in diffs]
        out.append(
            InputDifference(
                field=name,
                values=values,
                group=input_group(name),
                changes=[change_of(value, reference) for value in values],
            )
        )
    return out


def input_groups(differences: Sequence[InputDifference]) -> list[InputGroup]:
    """The groups that hold differences, each counted: data files by what happened to them
    ("1 added, 2 changed"), the others by fields."""
    out = []
    for name, title in INPUT_GROUPS:
        members = [d for d in differences if d.group == name]
        if not members:
            continue
        if name == "data":
            counts = {
                kind: sum(1 for d in members if kind in d.changes)
                for kind in ("added", "removed", "changed")
            }
            summary = ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)
        else:
            summary = f"{len(members)} field{'s' if len(members) != 1 else ''}"
        out.append(InputGroup(name=name, title=title, count=len(members), summary=summary))
    return out


def input_diff(runs: Sequence[Run]) -> InputDiff:
    differences = input_differences([run.signature_components for run in runs])
    same_signature = len({run.signature for run in runs}) == 1
    groups = input_groups(differences)
    if not differences:
        summary = (
            f"identical inputs: the {len(runs)} runs signed the same workflow, tokenizer, data "
            "files and initial weights"
        )
    else:
        named = "; ".join(f"{g.title} ({g.summary})" for g in groups)
        summary = f"{len(differences)} input field(s) differ: {named}"
    return InputDiff(
        identical=not differences,
        same_signature=same_signature,
        differences=differences,
        groups=groups,
        summary=summary,
    )


def eval_edges(*, session: Session, run_ids: Sequence[str]) -> list[Any]:
    """Per run and eval set, at most three rows: its step-0 evaluation, its highest step and
    its lowest cross-entropy (the earliest step on ties; evaluations without one come last).
    Window functions pick them in the database (Postgres and SQLite alike)."""
    partition = (EvalResult.run_id, EvalResult.name)
    ranked = select(
        EvalResult.run_id,
        EvalResult.name,
        EvalResult.task,
        EvalResult.step,
        EvalResult.cross_entropy,
        EvalResult.perplexity,
        func.row_number()
        .over(partition_by=partition, order_by=EvalResult.step.desc())
        .label("latest_rank"),
        func.row_number()
        .over(
            partition_by=partition,
            order_by=(
                EvalResult.cross_entropy.is_(None),
                EvalResult.cross_entropy,
                EvalResult.step,
            ),
        )
        .label("best_rank"),
    ).where(EvalResult.run_id.in_(list(run_ids)))
    inner = ranked.subquery()
    query = select(inner).where(
        or_(inner.c.latest_rank == 1, inner.c.best_rank == 1, inner.c.step == 0)
    )
    return list(session.execute(query).all())


def _at(row: Any) -> EvalAt:
    return EvalAt(
        step=row.step,
        cross_entropy=json_float(row.cross_entropy),
        perplexity=json_float(row.perplexity),
    )


def _perplexity(point: EvalAt | None) -> float | None:
    return None if point is None else point.perplexity


def eval_table(*, run_ids: Sequence[str], rows: Sequence[Any]) -> list[ComparedEvalSet]:
    """The eval sets by runs table from eval_edges' rows, sets by name, runs in order."""
    found: dict[tuple[str, str], dict[str, EvalAt | None]] = {}
    tasks: dict[str, str] = {}
    for row in rows:
        tasks.setdefault(row.name, row.task)
        cell = found.setdefault((row.name, row.run_id), {})
        if row.step == 0:
            cell["baseline"] = _at(row)
        if row.latest_rank == 1:
            cell["final"] = _at(row)
        if row.best_rank == 1 and row.cross_entropy is not None:
            cell["best"] = _at(row)
    table = []
    for name in sorted(tasks):
        cells = [found.get((name, run_id), {}) for run_id in run_ids]
        first = cells[0]
        compared = []
        for i, (run_id, cell) in enumerate(zip(run_ids, cells, strict=True)):
            final, best, baseline = cell.get("final"), cell.get("best"), cell.get("baseline")
            compared.append(
                ComparedEval(
                    run_id=run_id,
                    baseline=baseline,
                    final=final,
                    best=best,
                    final_vs_first=None
                    if i == 0
                    else percent_change(_perplexity(final), _perplexity(first.get("final"))),
                    best_vs_first=None
                    if i == 0
                    else percent_change(_perplexity(best), _perplexity(first.get("best"))),
                    final_vs_baseline=percent_change(_perplexity(final), _perplexity(baseline)),
                )
            )
        table.append(ComparedEvalSet(name=name, task=tasks[name], runs=compared))
    return table


def compared_run(run: Run, tags: list[str]) -> ComparedRun:
    plan = Plan.model_validate(run.plan)
    return ComparedRun(
        id=run.id,
        name=run.name,
        status=RunStatus(run.status),
        step=run.step,
        total_steps=run.total_steps,
        signature=run.signature,
        tags=tags,
        note=run.note,
        phases=[
            ComparedPhase(name=p.name, first_step=p.first_step, last_step=p.last_step)
            for p in plan.phases
        ],
        created_at=run.created_at,
        finished_at=run.finished_at,
    )


def compare_runs(*, session: Session, runs: Sequence[Run]) -> RunComparison:
    """The comparison of `runs` (two or more, the first the reference), in their order."""
    ids = [run.id for run in runs]
    tags = run_tags(session=session, run_ids=ids)
    return RunComparison(
        runs=[compared_run(run, tags[run.id]) for run in runs],
        evals=eval_table(run_ids=ids, rows=eval_edges(session=session, run_ids=ids)),
        inputs=input_diff(runs),
    )
