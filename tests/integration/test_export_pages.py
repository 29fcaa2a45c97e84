"""The CSV export of metrics reads every point in pages by key, (name, step) after the last
page's: pages join without a gap or a repeat, on both databases, and a filter by name or a
thinned read gives what the JSON answer does."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
from sqlalchemy import text

from service.db import make_engine, make_session_factory, upgrade_database
from service.reads.export import metrics_csv
from service.reads.series import metric_columns

pytestmark = pytest.mark.integration

NOW = "2026-12-01 12:00:00"
SERIES = {"grad_norm": 7, "loss": 10, "lr": 1}  # name: points (steps 1..n)


def value(name: str, step: int) -> float | None:
    return None if (name, step) == ("loss", 4) else step / 3 + len(name)


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
@pytest.mark.parametrize("page_rows", [1, 3, 18, 10_000])
def test_pages_of_the_export_join_into_every_point_in_order(
    database: str, page_rows: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = (
        f"sqlite:///{tmp_path / 'trainctl.db'}"
        if database == "sqlite"
        else request.getfixturevalue("empty_postgres_url")
    )
    upgrade_database(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO workflows (id, name, spec, created_at) "
                    "VALUES ('w', 'w', '{}', :now)"
                ),
                {"now": NOW},
            )
            for run in ("run_a", "run_b"):
                conn.execute(
                    text(
                        "INSERT INTO runs (id, workflow_id, name, status, signature, "
                        "signature_components, plan, phase_index, step, total_steps, "
                        "max_restarts, max_preemptions, created_at, updated_at) VALUES "
                        "(:run, 'w', 'r', 'running', 's', '{}', '{}', 0, 0, 10, 3, 3, :now, :now)"
                    ),
                    {"run": run, "now": NOW},
                )
                conn.execute(
                    text(
                        "INSERT INTO attempts (id, run_id, number, phase_index, status) "
                        "VALUES (:attempt, :run, 1, 0, 'running')"
                    ),
                    {"attempt": f"att_{run}", "run": run},
                )
            points = [
                {
                    "run": run,
                    "attempt": f"att_{run}",
                    "name": name,
                    "step": step,
                    "value": value(name, step),
                }
                for run in ("run_a", "run_b")
                for name, n in SERIES.items()
                for step in range(1, n + 1)
            ]
            conn.execute(
                text(
                    "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
                    "VALUES (:run, :name, :step, :value, :attempt)"
                ),
                points,
            )
        sessions = make_session_factory(engine)

        def exported(names: list[str] | None, max_points: int | None) -> list[list[str]]:
            chunks = metrics_csv(
                sessions=sessions,
                run_id="run_a",
                names=names,
                max_points=max_points,
                page_rows=page_rows,
            )
            return list(csv.reader(io.StringIO("".join(chunks))))

        rows = exported(names=None, max_points=None)
        assert rows[0] == ["run_id", "name", "step", "value"]
        expected = [
            ["run_a", name, str(step), "" if value(name, step) is None else repr(value(name, step))]
            for name in sorted(SERIES)
            for step in range(1, SERIES[name] + 1)
        ]
        assert rows[1:] == expected
        assert exported(names=["lr", "loss"], max_points=None)[1:] == [
            r for r in expected if r[1] in ("lr", "loss")
        ]
        thinned = exported(names=["loss"], max_points=4)[1:]
        with sessions() as session:
            columns = metric_columns(session=session, run_id="run_a", names=["loss"], max_points=4)
        assert [int(r[2]) for r in thinned] == columns["loss"]["steps"]
    finally:
        engine.dispose()
