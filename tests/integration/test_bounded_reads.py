"""Reads that cost what they return, not what the run stored, on real Postgres: metric series
thinned by the database, `GET /runs` paged by a cursor, and the events stream's polls.

"Rows touched" is measured, not timed: every statement a read ran is run again under EXPLAIN
ANALYZE and the rows its scans produced or filtered out are added up.
"""

from __future__ import annotations

import base64
import itertools
import json
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from procs import Stack, processes, run_cli
from sqlalchemy import Engine, event, text, update
from sqlalchemy.orm import Session

from contracts.bounds import MAX_COUNT
from service.api.routes.events import MAX_ROWS_PER_EVENT, RunEvents, StepCursor
from service.db import make_engine
from service.models import Run, utcnow
from service.reads.evaluation import eval_by_phase
from service.reads.series import metric_columns, metric_series_json

if TYPE_CHECKING:
    from conftest import Api, ApiFactory, SettingsFactory, WorkflowFactory

pytestmark = pytest.mark.integration


@pytest.fixture
def api(make_settings: SettingsFactory, make_api: ApiFactory) -> Api:
    return make_api(make_settings())


def submit(api: Api, doc: dict[str, Any], name: str = "r") -> dict[str, Any]:
    response = api.client.post("/runs", json={"workflow": doc, "name": name}, headers=api.admin)
    assert response.status_code == 201, response.text
    return dict(response.json())


def add_points(session: Session, run: dict[str, Any], name: str, steps: list[int]) -> None:
    """Points straight into the table (the ingest path is not what these tests are about);
    value = step / 2, so a value shows which step it was read from."""
    session.execute(
        text(
            "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
            "SELECT :run, :name, s, s / 2.0, :attempt FROM unnest(CAST(:steps AS int[])) s"
        ),
        {"run": run["id"], "name": name, "steps": steps, "attempt": run["attempts"][0]["id"]},
    )


def add_evals(session: Session, run: dict[str, Any], name: str, steps: range) -> None:
    session.execute(
        text(
            "INSERT INTO evals (run_id, name, step, task, attempt_id, phase, cross_entropy, "
            "perplexity, records, target_tokens, oversized_records) "
            "SELECT :run, :name, s, 'summarization', :attempt, 'phase0', 1.0, 2.7, 1, 10, 0 "
            "FROM generate_series(CAST(:first AS int), CAST(:last AS int)) s"
        ),
        {
            "run": run["id"],
            "name": name,
            "first": steps.start,
            "last": steps.stop - 1,
            "attempt": run["attempts"][0]["id"],
        },
    )


def _rows_in(plan: dict[str, Any]) -> int:
    touched = 0
    if "Scan" in plan["Node Type"]:
        per_loop = (
            plan["Actual Rows"]
            + plan.get("Rows Removed by Filter", 0)
            + plan.get("Rows Removed by Index Recheck", 0)
        )
        touched += per_loop * plan["Actual Loops"]
    return touched + sum(_rows_in(child) for child in plan.get("Plans", []))


@contextmanager
def rows_touched(engine: Engine) -> Iterator[Callable[[], int]]:
    """`rows()` after the block: the rows the block's statements scanned (EXPLAIN ANALYZE)."""
    statements: list[tuple[str, Any]] = []

    def note(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", note)
    total: list[int] = []
    try:
        yield lambda: total[0]
    finally:
        event.remove(engine, "before_cursor_execute", note)
    with engine.connect() as conn:
        plans = [
            conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, parameters)
            for statement, parameters in statements
        ]
        total.append(sum(_rows_in(result.scalar_one()[0]["Plan"]) for result in plans))


def engine_of(api: Api) -> Engine:
    engine = api.sessions.kw["bind"]
    assert isinstance(engine, Engine)
    return engine


# --- metric series thinned by the database ----------------------------------------------------

DENSE = list(range(20_001))  # a point at every step from 0: the first is step 0
TENS = list(range(10, 30_001, 10))
SPARSE = sorted(random.Random(7).sample(range(1, 1_000_000), 300))


def test_thinned_series_keep_first_and_last_and_read_the_stored_points(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, tiny_workflow())
    with api.sessions.begin() as session:
        for name, steps in (("dense", DENSE), ("tens", TENS), ("sparse", SPARSE)):
            add_points(session, run, name, steps)

    def read(**params: Any) -> dict[str, dict[str, list[Any]]]:
        response = api.client.get(f"/runs/{run['id']}/metrics", params=params, headers=api.admin)
        assert response.status_code == 200, response.text
        return dict(response.json())

    full = read()
    assert {name: column["steps"] for name, column in full.items()} == {
        "dense": DENSE,
        "sparse": SPARSE,
        "tens": TENS,
    }
    for max_points in (1, 2, 3, 50, 1000, 40_000):
        thinned = read(max_points=max_points)
        assert list(thinned) == ["dense", "sparse", "tens"]
        for name, column in thinned.items():
            steps, stored = column["steps"], full[name]["steps"]
            assert len(steps) <= max_points, (name, max_points)
            assert steps[-1] == stored[-1]  # the newest value is always shown
            if max_points > 1:
                assert steps[0] == stored[0]
            assert steps == sorted(set(steps))
            value_at = dict(zip(stored, full[name]["values"], strict=True))
            assert column["values"] == [value_at[step] for step in steps]
            if len(stored) <= max_points:
                assert steps == stored
            elif name == "dense" and max_points > 2:
                # Evenly spaced by a power of two: at least half the points asked for.
                assert len(steps) >= max_points // 2
                gaps = {b - a for a, b in itertools.pairwise(steps[:-1])}
                assert len(gaps) == 1
    only = read(max_points=100, names="tens,nothing")
    assert list(only) == ["tens"]
    assert read(max_points=MAX_COUNT, names="dense")["dense"]["steps"] == DENSE
    huge = api.client.get(
        f"/runs/{run['id']}/metrics", params={"max_points": MAX_COUNT + 1}, headers=api.admin
    )
    assert huge.status_code == 422, huge.text
    assert [d["path"] for d in huge.json()["error"]["details"]] == ["query.max_points"]


def test_a_thinned_read_touches_rows_in_proportion_to_the_points_returned(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    run = submit(api, tiny_workflow())
    names = ("a", "b", "c")
    with api.sessions.begin() as session:
        for name in names:
            add_points(session, run, name, DENSE)
    with api.sessions() as session, rows_touched(engine_of(api)) as rows:
        thinned = metric_columns(session=session, run_id=run["id"], names=None, max_points=200)
    returned = sum(len(column["steps"]) for column in thinned.values())
    assert returned > 3 * 100
    # Reading every point, as the read did before, touched 3 x 20,001 rows.
    assert rows() <= 2 * returned + 50 * len(names), (rows(), returned)
    # So does the body Postgres writes as JSON, which the API answers.
    with api.sessions() as session, rows_touched(engine_of(api)) as rows:
        body = metric_series_json(session=session, run_id=run["id"], names=None, max_points=200)
    assert json.loads(body) == thinned
    assert rows() <= 2 * returned + 50 * len(names), (rows(), returned)


# Values whose JSON text Postgres and Python write differently, or not at all: integral
# floats (`3` / `3.0`), extremes, the shortest exact repr, negative zero; and non-finite
# values of rows stored before they were refused (NaN and inf), answered as null like NULL.
EDGE_VALUES = [
    3.0,
    -0.0,
    0.1 + 0.2,
    1e-05,
    1e16,
    1.7976931348623157e308,
    5e-324,
    -2.2250738585072014e-308,
    123456789.123456789,
    float("nan"),
    float("inf"),
    float("-inf"),
    None,
]


def bits(values: list[float | None]) -> list[str | None]:
    return [None if v is None else float(v).hex() for v in values]


def test_the_json_postgres_writes_is_what_python_answered(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    """GET /runs/{id}/metrics answers the body Postgres wrote (metric_series_json); it holds
    exactly the values metric_columns reads and Python encodes: every float bit for bit,
    non-finite and NULL values as null, any name, any max_points."""
    run = submit(api, tiny_workflow())
    attempt = run["attempts"][0]["id"]
    series: dict[str, list[tuple[int, float | None]]] = {
        'quote " back \\ slash': [(s, EDGE_VALUES[s % len(EDGE_VALUES)]) for s in range(0, 400)],
        "ünïcødé/loss ✓": [(s, EDGE_VALUES[s % len(EDGE_VALUES)]) for s in range(5, 9000, 7)],
        "one point": [(12, float("nan"))],
        "two points": [(0, None), (3, float("inf"))],
        "edges": [(s, EDGE_VALUES[-(s % 5) - 1]) for s in (1, 2, 3, 1000, MAX_COUNT)],
    }
    with api.sessions.begin() as session:
        for name, points in series.items():
            session.execute(
                text(
                    "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
                    "SELECT :run, :name, p.step, p.value, :attempt FROM unnest("
                    "CAST(:steps AS int[]), CAST(:values AS float8[])) AS p(step, value)"
                ),
                {
                    "run": run["id"],
                    "name": name,
                    "steps": [step for step, _ in points],
                    "values": [value for _, value in points],
                    "attempt": attempt,
                },
            )
    for max_points in (None, 1, 2, 3, 7, 64, 1000, MAX_COUNT):
        for names in (None, ["edges", "nothing", "edges"], ["ünïcødé/loss ✓", "one point"]):
            with api.sessions() as session:
                python = metric_columns(
                    session=session, run_id=run["id"], names=names, max_points=max_points
                )
                body = metric_series_json(
                    session=session, run_id=run["id"], names=names, max_points=max_points
                )
            answered = json.loads(body)
            assert answered == python, (max_points, names)
            # Bit for bit (-0.0 == 0.0 in Python): Postgres writes an integral float as an
            # integer (`3`, `-0`), the same JSON number, which Python reads as an int unless
            # told otherwise.
            as_floats = json.loads(body, parse_int=float)
            assert {n: bits(c["values"]) for n, c in as_floats.items()} == {
                n: bits(c["values"]) for n, c in python.items()
            }
            if max_points is None and names is None:
                stored = {n: [s for s, _ in points] for n, points in series.items()}
                assert {n: c["steps"] for n, c in answered.items()} == stored
                assert answered["two points"]["values"] == [None, None]
    response = api.client.get(
        f"/runs/{run['id']}/metrics", params={"max_points": 64}, headers=api.admin
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    with api.sessions() as session:
        assert response.json() == metric_columns(
            session=session, run_id=run["id"], names=None, max_points=64
        )


# --- GET /runs, paged ------------------------------------------------------------------------


def test_runs_pages_walk_every_run_once_newest_first_while_runs_are_created(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    doc = tiny_workflow()
    ids = [submit(api, doc, f"r{i}")["id"] for i in range(7)]
    # Ties on created_at are ordered by id: runs 1 and 2 share a time, and 4, 5 and 6.
    seconds = dict(zip(ids, [0, 1, 1, 3, 4, 4, 4], strict=True))
    base = utcnow() - timedelta(hours=1)
    with api.sessions.begin() as session:
        for run_id, offset in seconds.items():
            at = base + timedelta(seconds=offset)
            session.execute(update(Run).where(Run.id == run_id).values(created_at=at))
    expected = sorted(ids, key=lambda run_id: (-seconds[run_id], run_id))

    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, Any] = {"limit": 3} | ({"cursor": cursor} if cursor else {})
        response = api.client.get("/runs", params=params, headers=api.admin)
        assert response.status_code == 200, response.text
        page = response.json()
        pages += 1
        seen += [run["id"] for run in page["runs"]]
        assert page["count"] == len(ids) + pages - 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
        submit(api, doc, f"new{pages}")  # newer than every page read: never in a later one
    assert seen == expected
    assert pages == 3

    everything = api.client.get("/runs", params={"limit": 500}, headers=api.admin).json()
    assert everything["next_cursor"] is None
    assert [run["id"] for run in everything["runs"]][-len(ids) :] == expected
    page = api.client.get("/runs", params={"limit": 2, "status": "queued"}, headers=api.admin)
    following = api.client.get(
        "/runs",
        params={"limit": 500, "status": "queued", "cursor": page.json()["next_cursor"]},
        headers=api.admin,
    ).json()
    assert [r["id"] for r in page.json()["runs"] + following["runs"]] == [
        r["id"] for r in everything["runs"]
    ]


def test_the_cli_follows_the_cursor_to_list_more_runs_than_a_page(
    tmp_path: Path, postgres_url: str, tiny_workflow: WorkflowFactory
) -> None:
    with processes() as procs:
        stack = Stack(tmp_path, postgres_url, procs, TRAINCTL_DATA_ROOT=str(tmp_path / "data"))
        with stack.api() as api:
            first = api.post("/runs", json={"workflow": tiny_workflow(), "name": "r"})
            assert first.status_code == 201, first.text
        # More runs than one page holds (500), as copies of that one, each a second older.
        engine = make_engine(postgres_url)
        try:
            with engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO runs (id, workflow_id, name, status, signature, "
                        "signature_components, plan, phase_index, step, total_steps, "
                        "max_restarts, max_preemptions, created_at, updated_at) "
                        "SELECT 'run_copy' || lpad(i::text, 4, '0'), workflow_id, name, status, "
                        "signature, signature_components, plan, phase_index, step, total_steps, "
                        "max_restarts, max_preemptions, created_at - make_interval(secs => i), "
                        "updated_at FROM runs, generate_series(1, 600) i WHERE id = :id"
                    ),
                    {"id": first.json()["id"]},
                )
        finally:
            engine.dispose()
        env = {**stack.env, "TRAINCTL_API_URL": stack.url, "TRAINCTL_TOKEN": stack.admin}
        every = json.loads(run_cli(["runs", "list", "--limit", "0", "--json"], env=env))
        expected = [first.json()["id"], *(f"run_copy{i:04d}" for i in range(1, 601))]
        assert [run["id"] for run in every["runs"]] == expected
        assert (every["count"], every["next_cursor"]) == (601, None)
        some = json.loads(run_cli(["runs", "list", "--limit", "550", "--json"], env=env))
        assert [run["id"] for run in some["runs"]] == expected[:550]
        assert some["next_cursor"] is not None
        assert "the 50 newest of 601" in run_cli(["runs", "list"], env=env)


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "not a cursor",
        base64.urlsafe_b64encode(b"[1, 2]").decode(),
        base64.urlsafe_b64encode(b'{"a": 1}').decode(),
        base64.urlsafe_b64encode(json.dumps(["2026-12-01T00:00:00", "run_x"]).encode()).decode(),
        base64.urlsafe_b64encode(json.dumps(["yesterday", "run_x"]).encode()).decode(),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),
    ],
)
def test_a_malformed_cursor_is_refused_naming_query_cursor(api: Api, cursor: str) -> None:
    response = api.client.get("/runs", params={"cursor": cursor}, headers=api.admin)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert set(error) == {"code", "message", "details"}
    assert error["code"] == "invalid_request"
    assert [d["path"] for d in error["details"]] == ["query.cursor"]
    assert "next_cursor" in error["details"][0]["message"]


# --- the events stream's polls ---------------------------------------------------------------


def poll_stream(api: Api, tiny_workflow: WorkflowFactory) -> RunEvents:
    """A stream of a run with 3 series of 20,001 points and 2 eval sets of 3,000 steps, that
    has sent most of them."""
    run = submit(api, tiny_workflow())
    with api.sessions.begin() as session:
        for name in ("a", "b", "c"):
            add_points(session, run, name, DENSE)
        for name in ("qa", "sum"):
            add_evals(session, run, name, range(3000))
    return RunEvents(
        run_id=run["id"],
        names=("a", "b", "c"),
        metrics=StepCursor(after=-1, sent={"a": 19_990, "b": 19_990}),
        evals=StepCursor(after=-1, sent={"qa": 2990, "sum": 2995}),
        lease_seconds=60,
        queue="q",
    )


def test_an_events_poll_reads_the_metric_points_after_its_cursors_only(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    stream = poll_stream(api, tiny_workflow)
    with api.sessions() as session, rows_touched(engine_of(api)) as rows:
        (metrics,), more = stream._metrics(session)
    assert more
    series = metrics[1]["series"]
    assert series["a"]["steps"] == list(range(19_991, 20_001))
    assert series["b"]["steps"] == list(range(19_991, 20_001))
    assert series["c"]["steps"] == list(range(MAX_ROWS_PER_EVENT - 20))
    # One OR of the names' conditions walked a and b from their first step: 40,000 rows.
    assert rows() <= 3 * MAX_ROWS_PER_EVENT + 100, rows()


def test_an_events_poll_reads_the_evaluations_after_its_cursors_only(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    stream = poll_stream(api, tiny_workflow)
    with api.sessions() as session, rows_touched(engine_of(api)) as rows:
        (evals,), more = stream._evals(session)
    assert not more
    # By step, then name: qa after its step 2990, sum after its step 2995.
    after = {"qa": 2990, "sum": 2995}
    assert [(p["name"], p["step"]) for p in evals[1]["points"]] == [
        (name, step) for step in range(2991, 3000) for name in ("qa", "sum") if step > after[name]
    ]
    # Filtering the run's evaluations read all 6,000 of them at every poll.
    assert rows() <= 100, rows()


def test_eval_by_phase_touches_a_few_rows_per_set_and_phase_whatever_the_history(
    api: Api, tiny_workflow: WorkflowFactory
) -> None:
    # Three phases of 1,000 steps and two eval sets evaluated at every step: 6,002 rows.
    run = submit(api, tiny_workflow(phases=3, steps=1000))
    with api.sessions.begin() as session:
        for name in ("qa", "sum"):
            add_evals(session, run, name, range(3001))
    with api.sessions() as session, rows_touched(engine_of(api)) as rows:
        answer = eval_by_phase(session=session, run=session.get_one(Run, run["id"]))
    assert [
        [(c.start and c.start.step, c.end and c.end.step) for c in p.sets] for p in answer.phases
    ] == [
        [(0, 1000)] * 2,
        [(1000, 2000)] * 2,
        [(2000, 3000)] * 2,
    ]
    # Filtering the run's evaluations by step would read all 6,002 of them.
    assert rows() <= 100, rows()
