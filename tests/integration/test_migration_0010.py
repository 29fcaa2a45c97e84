"""Migration 0010: runs and jobs made before owners were recorded keep no owner, so admins and
viewers read them and no user does; its downgrade drops owners and the audit trail and deletes
user and viewer tokens (the old check refuses them), keeping the runs. On both databases."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import text

from contracts.workflow import Workflow, plan
from service.auth import create_token
from service.db import (
    alembic_config,
    downgrade_database,
    make_engine,
    upgrade_database,
)

if TYPE_CHECKING:
    from conftest import ApiFactory, SettingsFactory

pytestmark = pytest.mark.integration

NOW = "2026-12-01 12:00:00"
WORKFLOW = {
    "name": "old",
    "model": {"config": {"vocab_size": 256, "max_position_embeddings": 128}},
    "tokenizer": "/data/tokenizer.json",
    "microbatch_tokens": 128,
    "phases": [
        {
            "name": "p",
            "objective": "continued_pretrain",
            "data": [{"path": "/data/a.jsonl"}],
            "sequence_length": 64,
            "microbatch_size": 2,
            "steps": 10,
        }
    ],
}
PLAN = plan(Workflow.model_validate(WORKFLOW)).model_dump_json()
# The revision 0010 follows.
PREVIOUS = (
    ScriptDirectory.from_config(alembic_config("sqlite://")).get_revision("0010").down_revision
)
assert isinstance(PREVIOUS, str)


def fill(url: str) -> None:
    """A run and a job as a database before 0010 holds them."""
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
                    "max_preemptions, created_at, updated_at, finished_at) VALUES ('run_old', "
                    "'w1', 'old', 'failed', 's', '{}', :plan, 0, 4, 10, 3, 3, :now, :now, :now)"
                ),
                {"now": NOW, "plan": PLAN},
            )
            conn.execute(
                text(
                    "INSERT INTO jobs (id, kind, status, request, created_at) "
                    "VALUES ('job_old', 'inspection', 'failed', '{}', :now)"
                ),
                {"now": NOW},
            )
    finally:
        engine.dispose()


def scalar(url: str, query: str) -> object:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return conn.execute(text(query)).scalar()
    finally:
        engine.dispose()


def test_old_rows_have_no_owner_and_the_downgrade_keeps_them(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade_database(url, PREVIOUS)
    fill(url)
    upgrade_database(url, "0010")
    assert scalar(url, "SELECT owner_id FROM runs WHERE id = 'run_old'") is None
    assert scalar(url, "SELECT owner_id FROM jobs WHERE id = 'job_old'") is None
    # Tokens as the schema of 0010 holds them (the ORM's models are the newest schema's).
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for token_id, role in (("tok_u", "user"), ("tok_a", "admin")):
                conn.execute(
                    text(
                        "INSERT INTO api_tokens (id, name, role, token_sha256, created_at) "
                        "VALUES (:id, :role, :role, :sha, CURRENT_TIMESTAMP)"
                    ),
                    {"id": token_id, "role": role, "sha": token_id * 8},
                )
    finally:
        engine.dispose()
    assert scalar(url, "SELECT count(*) FROM api_tokens") == 2

    downgrade_database(url, PREVIOUS)
    assert scalar(url, "SELECT count(*) FROM runs") == 1
    assert scalar(url, "SELECT count(*) FROM jobs") == 1
    assert scalar(url, "SELECT role FROM api_tokens") == "admin"  # the user token is gone
    upgrade_database(url)


def test_runs_from_before_owners_are_read_by_admins_and_viewers_only(
    empty_postgres_url: str, make_settings: SettingsFactory, make_api: ApiFactory
) -> None:
    upgrade_database(empty_postgres_url, PREVIOUS)
    fill(empty_postgres_url)
    upgrade_database(empty_postgres_url)
    api = make_api(make_settings(database_url=empty_postgres_url))
    with api.sessions() as session:
        user = create_token(session=session, name="user", role="user")
        viewer = create_token(session=session, name="viewer", role="viewer")

    for headers in (api.admin, {"Authorization": f"Bearer {viewer}"}):
        response = api.client.get("/runs/run_old", headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["status"] == "failed"
        assert api.client.get("/runs", headers=headers).json()["count"] == 1
        job = api.client.get("/datasets/inspections/job_old", headers=headers)
        assert job.status_code == 200, job.text

    as_user = {"Authorization": f"Bearer {user}"}
    assert api.client.get("/runs/run_old", headers=as_user).status_code == 404
    assert api.client.get("/runs", headers=as_user).json() == {
        "runs": [],
        "count": 0,
        "next_cursor": None,
    }
    assert api.client.get("/datasets/inspections/job_old", headers=as_user).status_code == 404
