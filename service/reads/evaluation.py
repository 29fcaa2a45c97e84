"""Evaluation summaries (`GET /runs/{id}/eval`): per eval set its baseline, latest, best and
history, and the first records it skipped; and an evaluation row as the API answers it, which
the event stream and the CSV export read too. Rows become plain JSON-able values, never
pydantic objects.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session

from service.models import EvalResult
from service.reads.series import downsample, json_float

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
