"""Migration 0016: workflows get owners, a row per (workflow, token) that stored or ran it. The
upgrade gives each run's owner its workflow; the downgrade drops the table and keeps every
workflow and run, on both databases."""

from __future__ import annotations

import pytest
from test_migration_0012 import execute, rows, tables

from service.db import downgrade_database, upgrade_database

pytestmark = pytest.mark.integration

OWNERS = "SELECT workflow_id, owner_id FROM workflow_owners ORDER BY workflow_id, owner_id"


def add_run(run: str, workflow: str, owner: str | None) -> str:
    owner_value = "NULL" if owner is None else f"'{owner}'"
    return (
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, owner_id, "
        f"created_at, updated_at) VALUES ('{run}', '{workflow}', '{run}', 'queued', 's', '{{}}', "
        f"'{{}}', 0, 0, 10, 3, 3, {owner_value}, :now, :now)"
    )


def test_each_run_s_owner_owns_its_workflow_and_the_downgrade_keeps_every_row(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0015")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES "
        "('w1', 'one', '{}', :now), ('w2', 'two', '{}', :now), ('w3', 'stored', '{}', :now)",
        add_run("run_a1", "w1", "tok_alice"),
        add_run("run_a2", "w1", "tok_alice"),  # twice: one row
        add_run("run_b1", "w1", "tok_bob"),
        add_run("run_old", "w2", None),  # from before owners: nobody's
        add_run("run_b2", "w2", "tok_bob"),
    )
    upgrade_database(url, "0016")
    assert rows(url, OWNERS) == [("w1", "tok_alice"), ("w1", "tok_bob"), ("w2", "tok_bob")]
    # w3 was stored without a run: who stored it was never recorded, so it has no owner.
    execute(url, "INSERT INTO workflow_owners (workflow_id, owner_id) VALUES ('w3', 'tok_carol')")

    downgrade_database(url, "0015")
    assert "workflow_owners" not in tables(url)
    assert rows(url, "SELECT id FROM workflows ORDER BY id") == [("w1",), ("w2",), ("w3",)]
    assert len(rows(url, "SELECT id FROM runs")) == 5
    upgrade_database(url)
    assert rows(url, OWNERS) == [("w1", "tok_alice"), ("w1", "tok_bob"), ("w2", "tok_bob")]
