"""A run's numbers as CSV, for notebooks and spreadsheets (`GET /runs/{id}/metrics.csv`,
`GET /runs/{id}/eval.csv`, `trainctl runs export`).

Metrics are long-form, one row per point (`pandas.read_csv(...).pivot(index="step",
columns="name", values="value")` makes them wide), in (name, step) order:

    run_id,name,step,value

Evaluations, one row per eval set and step, in (name, step) order:

    run_id,name,task,step,phase,cross_entropy,perplexity,records,target_tokens,oversized_records,
    skipped_malformed_json,skipped_wrong_shape,skipped_no_target

(`skipped_<reason>`: the records skipped for each reason of contracts.reports.SKIP_REASONS.)

An empty cell is a value that is not a finite number. Every point is exported unless
`max_points` thins the series as the JSON answer does (service.reads.series.thin_series); the points
are read in pages of PAGE_ROWS by key, each page in a short session of its own, so an export of
millions of points holds one page in memory and no connection between pages.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session

from contracts.reports import SKIP_REASONS
from service.models import EvalResult, MetricPoint
from service.reads import evaluation
from service.reads.series import json_float, metric_columns

METRIC_COLUMNS = ("run_id", "name", "step", "value")
EVAL_COLUMNS = (
    "run_id",
    "name",
    "task",
    "step",
    "phase",
    "cross_entropy",
    "perplexity",
    "records",
    "target_tokens",
    "oversized_records",
    *(f"skipped_{reason}" for reason in SKIP_REASONS),
)
PAGE_ROWS = 10_000


def csv_text(rows: Iterable[Iterable[Any]]) -> str:
    """Rows as CSV lines (\\r\\n-terminated, as the csv module and RFC 4180 write them); None
    as an empty cell, floats as Python's shortest exact repr."""
    out = io.StringIO()
    writer = csv.writer(out)
    for row in rows:
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue()


def metric_pages(
    *, session: Session, run_id: str, names: list[str] | None, page_rows: int = PAGE_ROWS
) -> Iterator[list[tuple[str, int, float | None]]]:
    """The run's metric points (of `names` only, when given) in (name, step) order, a page of
    at most `page_rows` at a time, each page one index range after the last one's key."""
    after: tuple[str, int] | None = None
    while True:
        query = select(MetricPoint.name, MetricPoint.step, MetricPoint.value).where(
            MetricPoint.run_id == run_id
        )
        if names:
            query = query.where(MetricPoint.name.in_(names))
        if after is not None:
            query = query.where(tuple_(MetricPoint.name, MetricPoint.step) > tuple_(*after))
        rows = session.execute(
            query.order_by(MetricPoint.name, MetricPoint.step).limit(page_rows)
        ).all()
        # Ends the page's transaction: nothing is held between pages.
        session.rollback()
        if not rows:
            return
        yield [(name, step, value) for name, step, value in rows]
        if len(rows) < page_rows:
            return
        after = (rows[-1][0], rows[-1][1])


def metrics_csv(
    *,
    sessions: Callable[[], Session],
    run_id: str,
    names: list[str] | None,
    max_points: int | None,
    page_rows: int = PAGE_ROWS,
) -> Iterator[str]:
    """The CSV of the run's metrics, header first, a chunk per page of points."""
    yield csv_text([METRIC_COLUMNS])
    if max_points is not None:
        with sessions() as session:
            columns = metric_columns(
                session=session, run_id=run_id, names=names, max_points=max_points
            )
        for name, column in columns.items():
            yield csv_text(
                (run_id, name, step, value)
                for step, value in zip(column["steps"], column["values"], strict=True)
            )
        return
    with sessions() as session:
        for page in metric_pages(session=session, run_id=run_id, names=names, page_rows=page_rows):
            yield csv_text((run_id, name, step, json_float(value)) for name, step, value in page)


def evals_csv(*, session: Session, run_id: str) -> str:
    """The CSV of the run's evaluations (which are few: read at once)."""
    rows = session.execute(
        select(*evaluation.EVAL_COLUMNS)
        .where(EvalResult.run_id == run_id)
        .order_by(EvalResult.name, EvalResult.step)
    ).all()
    return csv_text(
        [
            EVAL_COLUMNS,
            *(
                (
                    run_id,
                    name,
                    task,
                    step,
                    phase,
                    json_float(ce),
                    json_float(ppl),
                    *counts,
                    *(skipped.get(reason, 0) for reason in SKIP_REASONS),
                )
                for name, task, step, phase, ce, ppl, *counts, skipped in rows
            ),
        ]
    )
