"""Bounded reads on SQLite, the embedded database (`trainctl up`, `make demo`): thinned metric
series through the step-level index, `GET /runs` cursors, and the events stream's polls. The
same statements run on Postgres in tests/integration/test_bounded_reads.py."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, insert
from sqlalchemy.orm import Session, sessionmaker

from contracts.reports import MetricBatch
from contracts.reports import MetricPoint as ReportedPoint
from service.api.routes.events import RunEvents, StepCursor
from service.db import make_session_factory, upgrade_database
from service.models import ApiToken, Attempt, EvalResult, MetricPoint, Run, Workflow
from service.reads.series import metric_columns
from service.runs.view import RunsCursor, list_runs
from service.workers.report import record_metrics

DENSE = list(range(5001))
SPARSE = sorted(random.Random(3).sample(range(1, 10**6), 200))


@pytest.fixture
def sessions(tmp_path: Path) -> sessionmaker[Session]:
    url = f"sqlite:///{tmp_path / 'reads.db'}"
    upgrade_database(url)
    return make_session_factory(url)


def add_run(session: Session, run_id: str = "run_1", created_at: datetime | None = None) -> str:
    if session.get(Workflow, "w" * 64) is None:
        session.add(Workflow(id="w" * 64, name="w", spec={}))
        session.flush()
    session.add(
        Run(
            id=run_id,
            workflow_id="w" * 64,
            name="r",
            signature="s" * 64,
            signature_components={},
            plan={},
            total_steps=1,
            max_restarts=0,
            max_preemptions=0,
            **({"created_at": created_at} if created_at else {}),
        )
    )
    session.flush()
    session.add(Attempt(id=f"att_{run_id}", run_id=run_id, number=1, phase_index=0))
    session.flush()
    return run_id


def add_points(session: Session, name: str, steps: list[int]) -> None:
    session.execute(
        insert(MetricPoint),
        [
            {"run_id": "run_1", "name": name, "step": s, "value": s / 2, "attempt_id": "att_run_1"}
            for s in steps
        ],
    )


@pytest.fixture
def series(sessions: sessionmaker[Session]) -> sessionmaker[Session]:
    with sessions.begin() as session:
        add_run(session)
        add_points(session, "dense", DENSE)
        add_points(session, "sparse", SPARSE)
        add_points(session, "single", [7])
    return sessions


@pytest.mark.parametrize("max_points", [1, 2, 3, 10, 150, 200, 1000, 10_000])
def test_thinned_series_hold_at_most_max_points_with_the_first_last_and_stored_values(
    series: sessionmaker[Session], max_points: int
) -> None:
    with series() as session:
        full = metric_columns(session=session, run_id="run_1", names=None, max_points=None)
        thinned = metric_columns(session=session, run_id="run_1", names=None, max_points=max_points)
    assert list(thinned) == ["dense", "single", "sparse"]
    for name, column in thinned.items():
        steps, stored = column["steps"], full[name]["steps"]
        assert len(steps) <= max_points
        assert steps[-1] == stored[-1]
        assert max_points == 1 or steps[0] == stored[0]
        assert steps == sorted(set(steps))
        value_at = dict(zip(stored, full[name]["values"], strict=True))
        assert column["values"] == [value_at[s] for s in steps]
        if len(stored) <= max_points:
            assert steps == stored
    if max_points > 2:
        assert len(thinned["dense"]["steps"]) >= max_points // 2


def test_a_thinned_read_uses_the_step_level_index_on_sqlite(
    series: sessionmaker[Session],
) -> None:
    statements: list[tuple[str, Any]] = []
    with series() as session:
        engine = session.get_bind()
        event.listen(
            engine,
            "before_cursor_execute",
            lambda _c, _cur, statement, params, *_: statements.append((statement, params)),
        )
        metric_columns(session=session, run_id="run_1", names=["dense"], max_points=100)
        plans = [
            " ".join(
                row[-1]
                for row in session.connection().exec_driver_sql(
                    "EXPLAIN QUERY PLAN " + statement, params
                )
            )
            for statement, params in statements
            if statement.startswith(("SELECT", "WITH"))
        ]
    assert any("ix_metrics_step_level" in plan for plan in plans), plans
    assert not any("SCAN metrics" in plan for plan in plans), plans


def test_runs_cursors_page_by_created_at_then_id_on_sqlite(
    sessions: sessionmaker[Session],
) -> None:
    base = datetime(2026, 12, 1, tzinfo=UTC)
    offsets = {"run_a": 0, "run_b": 1, "run_c": 1, "run_d": 2, "run_e": 2.000001}
    with sessions.begin() as session:
        for run_id, seconds in offsets.items():
            add_run(session, run_id, base + timedelta(seconds=seconds))
    seen: list[str] = []
    after = None
    with sessions() as session:
        while True:
            runs, count, after = list_runs(session=session, limit=2, status=None, after=after)
            seen += [run.id for run in runs]
            assert count == 5
            if after is None:
                break
            after = RunsCursor.parse(after.encode())
    assert seen == ["run_e", "run_d", "run_b", "run_c", "run_a"]


@pytest.mark.parametrize("cursor", ["", "x", "W10", "WyJub3QgYSB0aW1lIiwgInIiXQ", "bnVsbA"])
def test_a_cursor_not_given_out_by_the_api_is_a_value_error(cursor: str) -> None:
    with pytest.raises(ValueError, match="next_cursor"):
        RunsCursor.parse(cursor)


def test_a_cursor_round_trips() -> None:
    cursor = RunsCursor(datetime(2026, 12, 1, 8, 0, 0, 123456, tzinfo=UTC), "run_0123456789ab")
    assert RunsCursor.parse(cursor.encode()) == cursor


def test_events_polls_read_after_each_cursor_on_sqlite(sessions: sessionmaker[Session]) -> None:
    with sessions.begin() as session:
        add_run(session)
        add_points(session, "a", list(range(1, 31)))
        add_points(session, "b", list(range(1, 31)))
        for name, task in (("qa", "qa"), ("rag", "qa")):
            session.execute(
                insert(EvalResult),
                [
                    {
                        "run_id": "run_1",
                        "name": name,
                        "step": step,
                        "task": task,
                        "attempt_id": "att_run_1",
                        "phase": "p",
                        "records": 1,
                        "target_tokens": 1,
                    }
                    for step in range(0, 30, 5)
                ],
            )
    stream = RunEvents(
        run_id="run_1",
        names=("a", "b", "missing"),
        metrics=StepCursor(after=10, sent={"a": 25}),
        evals=StepCursor(after=5, sent={"rag": 20}),
        lease_seconds=60,
        queue="q",
    )
    with sessions() as session:
        (metrics,), more = stream._metrics(session)
        assert not more
        assert metrics[1]["series"] == {
            "a": {"steps": [26, 27, 28, 29, 30], "values": [13.0, 13.5, 14.0, 14.5, 15.0]},
            "b": {"steps": list(range(11, 31)), "values": [s / 2 for s in range(11, 31)]},
        }
        assert stream._metrics(session) == ([], False)
        (evals,), more = stream._evals(session)
        assert [(p["name"], p["step"]) for p in evals[1]["points"]] == [
            ("qa", 10),
            ("qa", 15),
            ("qa", 20),
            ("qa", 25),
            ("rag", 25),
        ]
        assert stream._evals(session) == ([], False)


def test_a_metrics_batch_is_upserted_point_by_point_on_sqlite(
    sessions: sessionmaker[Session],
) -> None:
    """The embedded database takes the batch as an executemany (Postgres as arrays); both
    overwrite a step reported again and refuse bad points one by one."""
    with sessions.begin() as session:
        add_run(session)
        token = ApiToken(name="w", role="worker", token_sha256="0" * 64)
        session.add(token)
        session.flush()
        attempt = session.get(Attempt, "att_run_1")
        assert attempt is not None
        attempt.status, attempt.fencing_token, attempt.claim_token_id = "running", "f", token.id
        session.add(
            MetricPoint(run_id="run_1", name="loss", step=1, value=9.0, attempt_id="att_run_1")
        )

    def report(session: Session, points: list[tuple[str, int, float]]) -> tuple[int, list[Any]]:
        batch = MetricBatch(
            fencing_token="f",
            points=[ReportedPoint(name=n, step=s, value=v) for n, s, v in points],
        )
        worker = session.get(ApiToken, token.id)
        assert worker is not None
        return record_metrics(
            session=session, attempt_id="att_run_1", batch=batch, token=worker, lease_seconds=60
        )

    with sessions() as session:
        stored, errors = report(
            session,
            [("loss", 1, 1.0), ("loss", 2, float("nan")), ("loss", 2, 2.0), ("lr", 2, 0.1)],
        )
        assert (stored, [e.index for e in errors]) == (3, [1])
        stored, errors = report(session, [("loss", 3, 3.0), ("loss", 3, 3.5)])
        assert (stored, errors) == (2, [])
        full = metric_columns(session=session, run_id="run_1", names=None, max_points=None)
    assert full == {
        "loss": {"steps": [1, 2, 3], "values": [1.0, 2.0, 3.5]},
        "lr": {"steps": [2], "values": [0.1]},
    }
