"""Migration 0020: who claimed each member of an attempt across workers, and the address a
worker advertises. Nullable columns on both databases; the downgrade drops them and keeps the
placement rows."""

from __future__ import annotations

import pytest
from test_migration_0012 import columns, execute, rows

from service.db import downgrade_database, upgrade_database

pytestmark = pytest.mark.integration


def test_member_claims_and_worker_addresses_come_and_go(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade_database(url, "0019")
    execute(
        url,
        "INSERT INTO workflows (id, name, spec, created_at) VALUES ('w1', 'w', '{}', :now)",
        "INSERT INTO runs (id, workflow_id, name, status, signature, signature_components, "
        "plan, phase_index, step, total_steps, max_restarts, max_preemptions, created_at, "
        "updated_at) VALUES ('run_1', 'w1', 'r', 'queued', 's', '{}', '{}', 0, 0, 4, "
        "3, 3, :now, :now)",
        "INSERT INTO attempts (id, run_id, number, phase_index, status) "
        "VALUES ('att_1', 'run_1', 1, 0, 'queued')",
        "INSERT INTO attempt_members (attempt_id, member, worker_id, placed_at) "
        "VALUES ('att_1', 1, 'host-2-abc', :now)",
        "INSERT INTO workers (hostname, pid, version, key, first_seen_at, last_seen_at) "
        "VALUES ('h', 1, 'v', 'k1', :now, :now)",
    )

    upgrade_database(url, "0020")
    assert rows(
        url, "SELECT claim_nonce, claim_token_id, worker_hostname, worker_pid FROM attempt_members"
    ) == [(None, None, None, None)]
    assert rows(url, "SELECT address FROM workers") == [(None,)]
    execute(
        url,
        "UPDATE attempt_members SET claim_nonce = 'n', worker_hostname = 'h2', worker_pid = 7",
        "UPDATE workers SET address = '10.0.0.5'",
    )

    downgrade_database(url, "0019")
    assert "claim_nonce" not in columns(url, "attempt_members")
    assert "address" not in columns(url, "workers")
    assert rows(url, "SELECT attempt_id, member FROM attempt_members") == [("att_1", 1)]
    upgrade_database(url)
    assert rows(url, "SELECT worker_pid FROM attempt_members") == [(None,)]
