"""Migration 0018: a table of object store inputs' digests, and jobs of kind `digest` that fill
it. Existing jobs are untouched; the downgrade drops the table and the digest jobs with their
outbox rows (the old check refuses them) and keeps every other job, on both databases."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError
from test_migration_0012 import execute, rows, tables

from service.db import downgrade_database, upgrade_database

pytestmark = pytest.mark.integration

SHA = "a" * 64


def add_job(job_id: str, kind: str) -> str:
    return (
        "INSERT INTO jobs (id, kind, status, request, created_at) "
        f"VALUES ('{job_id}', '{kind}', 'queued', '{{}}', :now)"
    )


def test_digest_jobs_and_their_table_come_and_go_with_other_jobs_kept(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0017")
    execute(url, add_job("job_inspect", "inspection"))
    with pytest.raises(IntegrityError):
        execute(url, add_job("job_early", "digest"))

    upgrade_database(url, "0018")
    execute(
        url,
        add_job("job_digest", "digest"),
        "INSERT INTO outbox (job_id, created_at) VALUES ('job_digest', :now)",
        "INSERT INTO input_digests (uri, fingerprint, job_id, created_at) "
        f"VALUES ('s3://b/data/x.jsonl', '{SHA}', 'job_digest', :now)",
        f"UPDATE input_digests SET sha256 = '{'b' * 64}', size = 5000000000",
    )
    assert rows(url, "SELECT uri, sha256, size, job_id FROM input_digests") == [
        ("s3://b/data/x.jsonl", "b" * 64, 5_000_000_000, "job_digest")
    ]
    # One row per URI and fingerprint.
    with pytest.raises(IntegrityError):
        execute(
            url,
            "INSERT INTO input_digests (uri, fingerprint, created_at) "
            f"VALUES ('s3://b/data/x.jsonl', '{SHA}', :now)",
        )

    downgrade_database(url, "0017")
    assert "input_digests" not in tables(url)
    assert rows(url, "SELECT id FROM jobs ORDER BY id") == [("job_inspect",)]
    assert rows(url, "SELECT job_id FROM outbox") == []
    upgrade_database(url)
    assert rows(url, "SELECT COUNT(*) FROM input_digests") == [(0,)]
