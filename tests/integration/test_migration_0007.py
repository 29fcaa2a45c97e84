"""Migration 0007: preparation jobs are allowed after it and removed (with their outbox rows)
by its downgrade, whose old check would refuse them; other jobs stay, on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from service.db import downgrade_database, make_engine, upgrade_database

pytestmark = pytest.mark.integration

NOW = "2026-12-06 12:00:00"


def add_job(url: str, job_id: str, kind: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, kind, status, request, created_at) "
                    "VALUES (:id, :kind, 'queued', '{}', :now)"
                ),
                {"id": job_id, "kind": kind, "now": NOW},
            )
            conn.execute(
                text("INSERT INTO outbox (job_id, created_at) VALUES (:id, :now)"),
                {"id": job_id, "now": NOW},
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


def test_preparation_jobs_exist_only_from_0007_on(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade_database(url, "0006")
    with pytest.raises(IntegrityError, match="ck_jobs_kind"):
        add_job(url, "job_early", "preparation")
    upgrade_database(url, "0007")
    add_job(url, "job_inspect", "inspection")
    add_job(url, "job_prepare", "preparation")

    downgrade_database(url, "0006")
    assert rows(url, "SELECT id, kind FROM jobs") == [("job_inspect", "inspection")]
    assert rows(url, "SELECT job_id FROM outbox") == [("job_inspect",)]
    with pytest.raises(IntegrityError, match="ck_jobs_kind"):
        add_job(url, "job_late", "preparation")
    upgrade_database(url)
    add_job(url, "job_again", "preparation")
