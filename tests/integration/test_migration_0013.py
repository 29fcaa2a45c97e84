"""Migration 0013: the metrics table loses its foreign keys (per-row triggers that were most of
an ingest's cost) and keeps what they did: a deleted run's points go with it, by a trigger.
Every stored point survives the upgrade and the downgrade, on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text
from test_migration_0012 import execute

from service.db import downgrade_database, make_engine, upgrade_database

pytestmark = pytest.mark.integration


def points(url: str) -> list[tuple[object, ...]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            query = (
                "SELECT run_id, name, step, value, attempt_id FROM metrics ORDER BY run_id, step"
            )
            return [tuple(row) for row in conn.execute(text(query))]
    finally:
        engine.dispose()


def metric_keys_and_indexes(url: str) -> tuple[set[str], set[str]]:
    """The tables metrics' foreign keys refer to, and its indexes by name (from the catalog:
    SQLAlchemy does not reflect SQLite's expression indexes)."""
    engine = make_engine(url)
    catalog = (
        "SELECT indexname FROM pg_indexes WHERE tablename = 'metrics'"
        if engine.dialect.name == "postgresql"
        else "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'metrics'"
    )
    try:
        keys = {fk["referred_table"] for fk in inspect(engine).get_foreign_keys("metrics")}
        with engine.connect() as conn:
            indexes = {str(name) for (name,) in conn.execute(text(catalog))}
        # The primary key's own index: pk_metrics on Postgres, an autoindex on SQLite.
        return keys, {name for name in indexes if name.startswith("ix_")}
    finally:
        engine.dispose()


def add_run(run: str, attempt: str) -> list[str]:
    return [
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, created_at, "
        f"updated_at) VALUES ('{run}', 'w1', '{run}', 'running', 's', '{{}}', '{{}}', 0, 2, 10, "
        "3, 3, :now, :now)",
        "INSERT INTO attempts (id, run_id, number, phase_index, status, fencing_token) "
        f"VALUES ('{attempt}', '{run}', 1, 0, 'running', 1)",
        "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
        f"VALUES ('{run}', 'loss', 1, 2.5, '{attempt}'), ('{run}', 'loss', 2, 2.25, '{attempt}')",
    ]


def test_points_keep_their_rows_lose_their_keys_and_go_with_their_run(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0012")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        *add_run("run_a", "att_a"),
        *add_run("run_b", "att_b"),
    )
    before = points(url)
    assert len(before) == 4
    assert metric_keys_and_indexes(url) == ({"runs", "attempts"}, {"ix_metrics_step_level"})

    upgrade_database(url, "0013")
    assert points(url) == before
    # No foreign keys; the thinned reads' index survives SQLite's copy of the table.
    assert metric_keys_and_indexes(url) == (set(), {"ix_metrics_step_level"})

    # Deleting a run (its attempts cascade by their own key) deletes its points, no others'.
    execute(url, "DELETE FROM runs WHERE id = 'run_a'")
    assert points(url) == [p for p in before if p[0] == "run_b"]

    # A point whose run is gone (written while nothing checked) does not block the downgrade,
    # which restores both keys.
    execute(
        url,
        "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
        "VALUES ('run_gone', 'loss', 1, 1.0, 'att_gone')",
    )
    downgrade_database(url, "0012")
    assert points(url) == [p for p in before if p[0] == "run_b"]
    assert metric_keys_and_indexes(url) == ({"runs", "attempts"}, {"ix_metrics_step_level"})
    upgrade_database(url)
    assert points(url) == [p for p in before if p[0] == "run_b"]
    execute(url, "DELETE FROM runs WHERE id = 'run_b'")
    assert points(url) == []
