"""Migration 0011: attempts from before device counts read as one device, runs as "as the
workflow asks" and workers as "not said"; the downgrade drops the counts and keeps every row,
on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from service.db import downgrade_database, make_engine, upgrade_database

pytestmark = pytest.mark.integration

NOW = "2026-12-01 12:00:00"


def fill(url: str) -> None:
    """A run with a queued attempt and a worker, as a database at 0010 holds them."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO workflows (id, name, spec, created_at) "
                    "VALUES ('w1', 'w', '{}', :now)"
                ),
                {"now": NOW},
            )
            conn.execute(
                text(
                    "INSERT INTO runs (id, workflow_id, name, status, signature, "
                    "signature_components, plan, phase_index, step, total_steps, max_restarts, "
                    "max_preemptions, created_at, updated_at) VALUES ('run_old', 'w1', 'old', "
                    "'queued', 's', '{}', '{}', 0, 0, 10, 3, 3, :now, :now)"
                ),
                {"now": NOW},
            )
            conn.execute(
                text(
                    "INSERT INTO attempts (id, run_id, number, phase_index, status) "
                    "VALUES ('att_old', 'run_old', 1, 0, 'queued')"
                )
            )
            conn.execute(
                text("INSERT INTO outbox (attempt_id, created_at) VALUES ('att_old', :now)"),
                {"now": NOW},
            )
            conn.execute(
                text(
                    "INSERT INTO workers (hostname, pid, version, queue, first_seen_at, "
                    "last_seen_at) VALUES ('gpu-1', 7, '0.1.0', 'trainctl', :now, :now)"
                ),
                {"now": NOW},
            )
    finally:
        engine.dispose()


def rows(url: str, query: str) -> list[tuple[object, ...]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(query))]
    finally:
        engine.dispose()


COUNTS = (
    "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM attempts), "
    "(SELECT count(*) FROM outbox), (SELECT count(*) FROM workers)"
)


def test_rows_from_before_device_counts_run_on_one_device_and_survive_the_downgrade(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0010")
    fill(url)
    upgrade_database(url, "0011")
    assert rows(url, COUNTS) == [(1, 1, 1, 1)]
    assert rows(url, "SELECT id, devices FROM attempts") == [("att_old", 1)]
    assert rows(url, "SELECT devices FROM runs") == [(None,)]
    assert rows(url, "SELECT devices, device_kind FROM workers") == [(None, None)]

    # A new attempt written without a count (an older service during a rolling deployment)
    # gets one device from the server default.
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO attempts (id, run_id, number, phase_index, status) "
                    "VALUES ('att_new', 'run_old', 2, 0, 'queued')"
                )
            )
            conn.execute(text("UPDATE attempts SET devices = 4 WHERE id = 'att_old'"))
    finally:
        engine.dispose()
    assert sorted(rows(url, "SELECT id, devices FROM attempts")) == [
        ("att_new", 1),
        ("att_old", 4),
    ]

    downgrade_database(url, "0010")
    assert rows(url, COUNTS) == [(1, 2, 1, 1)]
    upgrade_database(url)
    assert sorted(rows(url, "SELECT id, devices FROM attempts")) == [
        ("att_new", 1),
        ("att_old", 1),
    ]
