"""Migration 0015: attempts count their messages sent again (0 for every earlier one), jobs their
deliveries (for earlier jobs, their outbox rows that were sent), and the outbox is indexed by
attempt. Every attempt, job and outbox row survives the upgrade and the downgrade, on both
databases."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect
from test_migration_0012 import columns, execute, rows

from service.db import downgrade_database, make_engine, upgrade_database

pytestmark = pytest.mark.integration


def outbox_indexes(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {str(index["name"]) for index in inspect(engine).get_indexes("outbox")}
    finally:
        engine.dispose()


JOBS = (("job_two", "running"), ("job_one", "queued"), ("job_none", "queued"))


def fill_0013(url: str) -> None:
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, created_at, "
        "updated_at) VALUES ('run_old', 'w1', 'old', 'queued', 's', '{}', '{}', 0, 0, 10, "
        "3, 3, :now, :now)",
        "INSERT INTO attempts (id, run_id, number, phase_index, status) "
        "VALUES ('att_old', 'run_old', 1, 0, 'queued')",
        "INSERT INTO outbox (attempt_id, created_at, sent_at) VALUES ('att_old', :now, :now)",
        # Sent twice (once more after a timeout), sent once and waiting to be sent again, and
        # never sent.
        *(
            "INSERT INTO jobs (id, kind, status, request, created_at) "
            f"VALUES ('{job}', 'inspection', '{status}', '{{}}', :now)"
            for job, status in JOBS
        ),
        "INSERT INTO outbox (job_id, created_at, sent_at) VALUES ('job_two', :now, :now)",
        "INSERT INTO outbox (job_id, created_at, sent_at) VALUES ('job_two', :now, :now)",
        "INSERT INTO outbox (job_id, created_at, sent_at) VALUES ('job_one', :now, :now)",
        "INSERT INTO outbox (job_id, created_at) VALUES ('job_one', :now)",
        "INSERT INTO outbox (job_id, created_at) VALUES ('job_none', :now)",
    )


def test_attempts_and_jobs_from_before_get_their_counts_and_survive_the_downgrade(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0014")
    fill_0013(url)
    assert "ix_outbox_attempt_id" not in outbox_indexes(url)

    upgrade_database(url, "0015")
    assert rows(url, "SELECT id, status, redispatches FROM attempts") == [("att_old", "queued", 0)]
    assert rows(url, "SELECT id, deliveries FROM jobs ORDER BY id") == [
        ("job_none", 0),
        ("job_one", 1),
        ("job_two", 2),
    ]
    assert "ix_outbox_attempt_id" in outbox_indexes(url)
    execute(
        url,
        "UPDATE attempts SET redispatches = redispatches + 1",
        "INSERT INTO outbox (attempt_id, created_at) VALUES ('att_old', :now)",
    )

    downgrade_database(url, "0014")
    assert "redispatches" not in columns(url, "attempts")
    assert "deliveries" not in columns(url, "jobs")
    assert "ix_outbox_attempt_id" not in outbox_indexes(url)
    assert rows(url, "SELECT id, status FROM attempts") == [("att_old", "queued")]
    assert rows(url, "SELECT count(*) FROM jobs") == [(3,)]
    assert rows(url, "SELECT count(*) FROM outbox") == [(7,)]
    upgrade_database(url)
    assert rows(url, "SELECT redispatches FROM attempts") == [(0,)]
    assert rows(url, "SELECT count(*) FROM outbox WHERE attempt_id = 'att_old'") == [(2,)]
