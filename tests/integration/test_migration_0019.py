"""Migration 0019: priorities, quotas, placement members, worker keys. Existing runs get
priority 0, tokens no cap, attempts a queued time (their run's last update) and one node; the
downgrade drops all of it and keeps every run and attempt, on both databases."""

from __future__ import annotations

import pytest
from test_migration_0012 import columns, execute, rows

from service.db import downgrade_database, upgrade_database

pytestmark = pytest.mark.integration


def test_runs_get_priority_zero_and_attempts_a_queued_time(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade_database(url, "0018")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, created_at, "
        "updated_at) VALUES ('run_1', 'w1', 'r', 'queued', 's', '{}', '{}', 0, 0, 4, "
        "3, 3, :now, :now)",
        "INSERT INTO attempts (id, run_id, number, phase_index, status) "
        "VALUES ('att_1', 'run_1', 1, 0, 'queued')",
        "INSERT INTO api_tokens (id, name, role, token_sha256, created_at) "
        "VALUES ('tok_1', 'alice', 'user', 'h', :now)",
    )

    upgrade_database(url, "0019")
    assert rows(url, "SELECT priority FROM runs") == [(0,)]
    assert rows(url, "SELECT max_devices FROM api_tokens") == [(None,)]
    assert rows(
        url, "SELECT nodes, queued_at IS NOT NULL, waiting_reason, yield_requested_at FROM attempts"
    ) == [(1, True, None, None)]
    assert rows(url, "SELECT id, passes FROM scheduler_state") == [(1, 0)]
    execute(
        url,
        "INSERT INTO attempt_members (attempt_id, member, worker_id, placed_at) "
        "VALUES ('att_1', 0, 'host-1-abc', :now)",
        "UPDATE runs SET priority = 7",
    )
    # One worker key names one worker.
    execute(
        url,
        "INSERT INTO workers (hostname, pid, version, key, first_seen_at, last_seen_at) "
        "VALUES ('h', 1, 'v', 'k1', :now, :now)",
    )
    with pytest.raises(Exception, match="(?i)unique"):
        execute(
            url,
            "INSERT INTO workers (hostname, pid, version, key, first_seen_at, "
            "last_seen_at) VALUES ('h', 2, 'v', 'k1', :now, :now)",
        )

    downgrade_database(url, "0018")
    assert "priority" not in columns(url, "runs")
    assert {"queued_at", "nodes", "waiting_reason", "yield_requested_at"}.isdisjoint(
        columns(url, "attempts")
    )
    assert rows(url, "SELECT id, status FROM attempts") == [("att_1", "queued")]
    upgrade_database(url)
    assert rows(url, "SELECT priority FROM runs") == [(0,)]
