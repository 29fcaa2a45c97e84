"""Migration 0014: the reaper's record of when a pass last heard the workers, one row that
starts unknown (NULL). Upgrade and downgrade keep every run and attempt, on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect
from test_migration_0012 import execute, rows
from test_migration_0013 import add_run

from service.db import downgrade_database, make_engine, upgrade_database

pytestmark = pytest.mark.integration

ATTEMPTS = "SELECT id, run_id, status FROM attempts ORDER BY id"


def has_reaper_state(url: str) -> bool:
    engine = make_engine(url)
    try:
        return "reaper_state" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def test_the_reaper_state_starts_unknown_and_runs_keep_their_rows(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0013")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        *add_run("run_a", "att_a"),
        *add_run("run_b", "att_b"),
    )
    before = rows(url, ATTEMPTS)
    assert len(before) == 2

    upgrade_database(url, "0014")
    assert rows(url, "SELECT id, heard_at FROM reaper_state") == [(1, None)]
    assert rows(url, ATTEMPTS) == before
    execute(url, "UPDATE reaper_state SET heard_at = :now")

    downgrade_database(url, "0013")
    assert not has_reaper_state(url)
    assert rows(url, ATTEMPTS) == before
    upgrade_database(url)
    assert rows(url, "SELECT id, heard_at FROM reaper_state") == [(1, None)]
    assert rows(url, ATTEMPTS) == before
