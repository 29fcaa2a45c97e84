"""Evaluation summaries (`GET /runs/{id}/eval`): per eval set its baseline, latest, best and
history, and the first records it skipped; each set phase by phase (`GET /runs/{id}/eval/phases`:
its value at each phase's end and the change over the phase); and an evaluation row as the API
answers it, which the event stream and the CSV export read too. Rows become plain JSON-able
values, never pydantic objects.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import Integer, func, literal, select, tuple_, union_all
from sqlalchemy.orm import Session

from contracts.api import EvalAt, EvalByPhase, EvalSetRef, PhaseEval, PhaseEvals
from contracts.workflow import Plan
from service.models import EvalResult, Run
from service.reads.compare import percent_change
from service.reads.series import downsample, json_float
from service.reads.thinning import series_names

EvalPoint = dict[str, Any]


def summarize_evals(
    points: list[EvalPoint], *, max_points: int | None = None
) -> dict[str, dict[str, Any]]:
    """Per eval set, by name: its `task`, `baseline` (the step-0 evaluation, before the first
    update, or None), `latest` (highest step), `best` (lowest cross-entropy; the earliest on
    ties) and `history` by step. `points` carry `name` and `task` keys, which the answer's
    points do not."""
    by_name: dict[str, list[EvalPoint]] = defaultdict(list)
    task_of: dict[str, str] = {}
    for point in points:
        task_of[point["name"]] = point["task"]
        by_name[point["name"]].append({k: v for k, v in point.items() if k not in ("name", "task")})
    sets = {}
    for name, history in sorted(by_name.items()):
        history.sort(key=lambda p: p["step"])
        scored = [p for p in history if p["cross_entropy"] is not None]
        sets[name] = {
            "task": task_of[name],
            "baseline": next((p for p in history if p["step"] == 0), None),
            "latest": history[-1],
            "best": min(scored, key=lambda p: (p["cross_entropy"], p["step"])) if scored else None,
            "history": downsample(history, max_points),
        }
    return sets


# An eval point as the API answers it, read straight from these columns.
EVAL_COLUMNS = (
    EvalResult.name,
    EvalResult.task,
    EvalResult.step,
    EvalResult.phase,
    EvalResult.cross_entropy,
    EvalResult.perplexity,
    EvalResult.records,
    EvalResult.target_tokens,
    EvalResult.oversized_records,
    EvalResult.skipped_records,
)


def eval_point(row: Any) -> EvalPoint:
    """A row of EVAL_COLUMNS as a JSON-able point (non-finite numbers as null)."""
    name, task, step, phase, ce, ppl, records, target_tokens, oversized, skipped = row
    return {
        "name": name,
        "task": task,
        "step": step,
        "phase": phase,
        "cross_entropy": json_float(ce),
        "perplexity": json_float(ppl),
        "records": records,
        "target_tokens": target_tokens,
        "oversized_records": oversized,
        "skipped_records": skipped,
    }


def eval_summary(*, session: Session, run_id: str, max_points: int | None = None) -> dict[str, Any]:
    """Per eval set its summary (summarize_evals) and `skipped_examples`: the first records its
    latest evaluation skipped, as "file:line: reason" (the same at every step of a run: its
    file and sequence_length are fixed), read from that one row per set, not from every
    point."""
    rows = session.execute(select(*EVAL_COLUMNS).where(EvalResult.run_id == run_id))
    points = [eval_point(row) for row in rows]
    sets = summarize_evals(points, max_points=max_points)
    latest = (
        select(EvalResult.name, func.max(EvalResult.step))
        .where(EvalResult.run_id == run_id)
        .group_by(EvalResult.name)
    )
    examples = session.execute(
        select(EvalResult.name, EvalResult.skipped_examples).where(
            EvalResult.run_id == run_id, tuple_(EvalResult.name, EvalResult.step).in_(latest)
        )
    )
    for name, skipped in examples:
        sets[name]["skipped_examples"] = skipped
    return {"run_id": run_id, "tasks": sets}


# (set, step) ranges per statement of `latest_at_or_before`: SQLite refuses a compound SELECT
# of more than 500 terms.
RANGES_PER_STATEMENT = 200


def latest_at_or_before(
    *, session: Session, run_id: str, steps: list[int]
) -> dict[tuple[str, int], Any]:
    """Per eval set and per step of `steps`: the set's latest evaluation at or before that step
    (a row of EVAL_COLUMNS), keyed (set, step); missing when the set has none by then. One
    LIMIT 1 range of the primary key per (set, step), the sets found by a skip scan: the read
    costs the sets times the steps, whatever the history holds."""
    found = series_names(EvalResult, run_id)
    names = session.scalars(select(found.c.name).where(found.c.name.is_not(None))).all()
    ranges = [
        select(
            select(literal(step, Integer).label("bound"), *EVAL_COLUMNS)
            .where(
                EvalResult.run_id == run_id,
                EvalResult.name == name,
                EvalResult.step <= step,
            )
            .order_by(EvalResult.step.desc())
            .limit(1)
            .subquery()
        )
        for name in names
        for step in steps
    ]
    out: dict[tuple[str, int], Any] = {}
    for i in range(0, len(ranges), RANGES_PER_STATEMENT):
        for bound, *row in session.execute(union_all(*ranges[i : i + RANGES_PER_STATEMENT])):
            out[(row[0], bound)] = row
    return out


def _at(row: Any | None) -> EvalAt | None:
    if row is None:
        return None
    point = eval_point(row)
    return EvalAt(
        step=point["step"], cross_entropy=point["cross_entropy"], perplexity=point["perplexity"]
    )


def eval_by_phase(*, session: Session, run: Run) -> EvalByPhase:
    """Each eval set at each phase's end and its change over the phase (forgetting: a
    pretraining set after a supervised phase; recovery: after a replay phase). The end is the
    evaluation at the phase's last step (workers always evaluate it); a phase still training,
    or one whose last evaluation is missing, shows its latest evaluation so far, not complete.
    The start is the latest evaluation at or before the phase's first update, so the previous
    phase's end or the baseline. Two rows per set and phase at most, whatever the history."""
    plan = Plan.model_validate(run.plan)
    starts = [phase.first_step - 1 for phase in plan.phases]
    bounds = sorted({*starts, *(phase.last_step for phase in plan.phases)})
    found = latest_at_or_before(session=session, run_id=run.id, steps=bounds)
    tasks = {row[0]: row[1] for row in found.values()}
    names = sorted(tasks)
    sets = [
        EvalSetRef(
            name=name,
            task=tasks[name],
            baseline=_at(row) if (row := found.get((name, 0))) and row[2] == 0 else None,
        )
        for name in names
    ]
    phases = []
    for index, (phase, start_step) in enumerate(zip(plan.phases, starts, strict=True)):
        cells = []
        for name in names:
            start = _at(found.get((name, start_step)))
            end = _at(found.get((name, phase.last_step)))
            if end is not None and end.step <= start_step:
                end = None  # nothing evaluated inside the phase yet
            cells.append(
                PhaseEval(
                    start=start,
                    end=end,
                    complete=end is not None and end.step == phase.last_step,
                    change=percent_change(
                        None if end is None else end.perplexity,
                        None if start is None else start.perplexity,
                    ),
                )
            )
        phases.append(
            PhaseEvals(
                index=index,
                name=phase.name,
                objective=phase.objective,
                role=phase.role,
                first_step=phase.first_step,
                last_step=phase.last_step,
                sets=cells,
            )
        )
    return EvalByPhase(run_id=run.id, sets=sets, phases=phases)
