"""Migration 0012: runs from before tags and notes have neither; a tag and a note are stored
and found; the downgrade drops both and keeps every run, on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect, text

from service.db import downgrade_database, make_engine, upgrade_database

pytestmark = pytest.mark.integration

NOW = "2026-12-01 12:00:00"


def execute(url: str, *statements: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for statement in statements:
                conn.execute(text(statement), {"now": NOW})
    finally:
        engine.dispose()


def rows(url: str, query: str) -> list[tuple[object, ...]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(query))]
    finally:
        engine.dispose()


def columns(url: str, table: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_runs_from_before_tags_have_none_and_survive_the_downgrade(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade_database(url, "0011")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, created_at, "
        "updated_at) VALUES ('run_old', 'w1', 'old', 'succeeded', 's', '{}', '{}', 0, 10, 10, "
        "3, 3, :now, :now)",
    )
    upgrade_database(url, "0012")
    assert rows(url, "SELECT id, note FROM runs") == [("run_old", None)]
    assert rows(url, "SELECT count(*) FROM run_tags") == [(0,)]

    execute(
        url,
        "UPDATE runs SET note = 'why' WHERE id = 'run_old'",
        "INSERT INTO run_tags (run_id, tag) VALUES ('run_old', 'baseline')",
        "INSERT INTO run_tags (run_id, tag) VALUES ('run_old', 'sweep')",
    )
    assert rows(url, "SELECT run_id FROM run_tags WHERE tag = 'sweep'") == [("run_old",)]
    assert rows(url, "SELECT note FROM runs") == [("why",)]

    downgrade_database(url, "0011")
    assert "run_tags" not in tables(url)
    assert "note" not in columns(url, "runs")
    assert rows(url, "SELECT id, status FROM runs") == [("run_old", "succeeded")]
    upgrade_database(url)
    assert rows(url, "SELECT id, note FROM runs") == [("run_old", None)]
