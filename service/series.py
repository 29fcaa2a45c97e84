"""Metric series and evaluation summaries, read straight from rows into plain JSON-able values.

Bulk rows never become pydantic objects: for tens of thousands of points, building columns
directly measured 3x faster than FastAPI's per-object encoding.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, TypeVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import EvalResult, MetricPoint

T = TypeVar("T")


def stride_indices(n: int, max_points: int | None) -> range | list[int]:
    """Indices keeping at most `max_points` of `n`: every k-th point from the first, plus the
    last (the newest value is always shown)."""
    if max_points is None or n <= max_points:
        return range(n)
    if max_points <= 1:
        return [n - 1] if n else []
    stride = math.ceil((n - 1) / (max_points - 1))
    return [*range(0, n - 1, stride), n - 1]


def downsample(items: list[T], max_points: int | None) -> list[T]:
    return [items[i] for i in stride_indices(len(items), max_points)]


def json_float(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def metric_columns(
    *, session: Session, run_id: str, names: list[str] | None, max_points: int | None
) -> dict[str, dict[str, list[Any]]]:
    """`{name: {"steps": [...], "values": [...]}}`, steps ascending, each series downsampled."""
    query = select(MetricPoint.name, MetricPoint.step, MetricPoint.value).where(
        MetricPoint.run_id == run_id
    )
    if names:
        query = query.where(MetricPoint.name.in_(names))
    steps: dict[str, list[int]] = defaultdict(list)
    values: dict[str, list[float | None]] = defaultdict(list)
    for name, step, value in session.execute(query.order_by(MetricPoint.name, MetricPoint.step)):
        steps[name].append(step)
        values[name].append(json_float(value))
    out: dict[str, dict[str, list[Any]]] = {}
    for name in steps:
        keep = stride_indices(len(steps[name]), max_points)
        out[name] = {
            "steps": [steps[name][i] for i in keep],
            "values": [values[name][i] for i in keep],
        }
    return out


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
)


def eval_point(row: Any) -> EvalPoint:
    """A row of EVAL_COLUMNS as a JSON-able point (non-finite numbers as null)."""
    name, task, step, phase, ce, ppl, records, target_tokens, oversized = row
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
    }


def eval_summary(*, session: Session, run_id: str, max_points: int | None = None) -> dict[str, Any]:
    rows = session.execute(select(*EVAL_COLUMNS).where(EvalResult.run_id == run_id))
    points = [eval_point(row) for row in rows]
    return {"run_id": run_id, "tasks": summarize_evals(points, max_points=max_points)}
