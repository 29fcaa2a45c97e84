"""Metric series, read straight from rows into plain JSON-able values: every point, or each
series thinned by the database (service.reads.thinning).

Bulk rows never become pydantic objects: for tens of thousands of points, building columns
directly measured 3x faster than FastAPI's per-object encoding.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from sqlalchemy import Float, Text, case, cast, func, literal, select
from sqlalchemy.dialects.postgresql import aggregate_order_by
from sqlalchemy.orm import Session

from service.models import MetricPoint
from service.reads.thinning import ends, thin

T = TypeVar("T")

# The most series one read may name (`names` on GET /runs/{id}/metrics and /events), each at
# most MAX_NAME characters (a metric name's column): a read costs an index range per name.
MAX_SERIES_PER_READ = 64


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
    """`{name: {"steps": [...], "values": [...]}}`, steps ascending, by name. With `max_points`
    each series is thinned by the database (`thin_series`); without, every point is read."""
    if max_points is not None:
        return thin_series(session=session, run_id=run_id, names=names, max_points=max_points)
    query = select(MetricPoint.name, MetricPoint.step, MetricPoint.value).where(
        MetricPoint.run_id == run_id
    )
    if names:
        query = query.where(MetricPoint.name.in_(names))
    out: dict[str, dict[str, list[Any]]] = {}
    rows = session.execute(query.order_by(MetricPoint.name, MetricPoint.step)).all()
    for name, step, value in rows:
        column = out.setdefault(name, {"steps": [], "values": []})
        column["steps"].append(step)
        column["values"].append(json_float(value))
    return out


def dump_json(content: Any) -> bytes:
    """`content` as JSON exactly as starlette's JSONResponse renders it."""
    return json.dumps(
        content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")
    ).encode("utf-8")


def metric_series_json(
    *, session: Session, run_id: str, names: list[str] | None, max_points: int | None
) -> bytes:
    """`metric_columns` as the JSON body of GET /runs/{id}/metrics. On Postgres the database
    writes each series' arrays as JSON text (array_to_json: float8 printed shortest-exact, as
    Python's repr; non-finite values as null) and Python only joins them, never parsing or
    encoding a point: for ten thinned series (7,830 points) that per-point Python was most
    of the read (bench/RESULTS.md). Elsewhere (SQLite) `metric_columns` encoded by Python.
    A number may be written differently (Postgres `3` where Python writes `3.0`); its value
    is the same."""
    if session.get_bind().dialect.name != "postgresql":
        return dump_json(
            metric_columns(session=session, run_id=run_id, names=names, max_points=max_points)
        )
    parts: list[str] = []
    if max_points is None:
        for name, steps, values in _full_series_json(session=session, run_id=run_id, names=names):
            parts.append(f'{_key(name)}{{"steps":{steps},"values":{values}}}')
    else:
        thinned = thin(
            session=session, run_id=run_id, names=names, max_points=max_points, as_json=True
        )
        for name, s in thinned.items():
            head, tail = ends(s, max_points)
            inner = ("[]", "[]") if s.kept is None else s.kept
            assert isinstance(inner[0], str) and isinstance(inner[1], str)
            steps = _join([p[0] for p in head], inner[0], [p[0] for p in tail])
            values = _join(
                [json_float(p[1]) for p in head], inner[1], [json_float(p[1]) for p in tail]
            )
            parts.append(f'{_key(name)}{{"steps":{steps},"values":{values}}}')
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False) + ":"


def _join(head: list[Any], inner: str, tail: list[Any]) -> str:
    """One JSON array: `head`'s items, those of the JSON array `inner`, `tail`'s items."""
    items = [json.dumps(v, allow_nan=False) for v in head]
    if inner != "[]":
        items.append(inner[1:-1])
    items += [json.dumps(v, allow_nan=False) for v in tail]
    return "[" + ",".join(items) + "]"


def _full_series_json(
    *, session: Session, run_id: str, names: list[str] | None
) -> list[tuple[str, str, str]]:
    """Every point of each series (of `names` only, when given), by name: its steps and
    values as JSON arrays written by Postgres, non-finite values as null."""
    step, value = MetricPoint.step, MetricPoint.value
    finite = case((func.abs(value) < literal(math.inf, Float), value))
    query = select(
        MetricPoint.name,
        cast(func.array_to_json(func.array_agg(aggregate_order_by(step, step))), Text),
        cast(func.array_to_json(func.array_agg(aggregate_order_by(finite, step))), Text),
    ).where(MetricPoint.run_id == run_id)
    if names:
        query = query.where(MetricPoint.name.in_(names))
    rows = session.execute(query.group_by(MetricPoint.name).order_by(MetricPoint.name)).all()
    return [(name, steps, values) for name, steps, values in rows]


def thin_series(
    *, session: Session, run_id: str, names: list[str] | None, max_points: int
) -> dict[str, dict[str, list[Any]]]:
    """At most `max_points` points per series, always its first and last, chosen by the
    database at a cost in the points returned, not in the points stored.

    Between the first and the last point, the points kept are those whose step is a multiple of a
    stride, a power of two: the finest stride whose multiples fit (every point when all fit; for a
    series with a point at every step, between half and all of `max_points`). Rows are found through
    ix_metrics_step_level (run, name, largest power of two dividing the step, step): the multiples
    of a stride 2^k are one range of it, read with a LIMIT just past the budget, so no read walks
    the series. The first stride is the one that fits a series with a point at every step of its
    span, which is exact for such a series (one read); otherwise a few more reads find the finest
    stride that fits (`thinning._Series.read`). Each round is one statement for every series still
    open.
    """
    out: dict[str, dict[str, list[Any]]] = {}
    for name, s in thin(
        session=session, run_id=run_id, names=names, max_points=max_points, as_json=False
    ).items():
        head, tail = ends(s, max_points)
        steps, values = s.kept if s.kept is not None else ([], [])
        assert isinstance(steps, list) and isinstance(values, list)
        out[name] = {
            "steps": [p[0] for p in head] + steps + [p[0] for p in tail],
            "values": [
                json_float(v) for v in [*(p[1] for p in head), *values, *(p[1] for p in tail)]
            ],
        }
    return out
