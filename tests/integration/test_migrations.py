"""Alembic is the only way the schema is made: up, down and up again, on both databases."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text

from service.db import downgrade_database, make_engine, upgrade_database
from service.models import Base

pytestmark = pytest.mark.integration

TABLES = {
    "workflows",
    "runs",
    "attempts",
    "checkpoints",
    "metrics",
    "evals",
    "outbox",
    "api_tokens",
    "jobs",
    "workers",
    "audit_events",
    "run_tags",
    "reaper_state",
    "workflow_owners",
    "input_digests",
    "attempt_members",
    "scheduler_state",
}


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def schema_drift(url: str) -> list[object]:
    """Differences between the migrated schema and the models (empty when in step)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def assert_up_down_up(url: str) -> None:
    upgrade_database(url)
    assert tables(url) == TABLES
    assert schema_drift(url) == []
    downgrade_database(url, "base")
    assert tables(url) == set()
    upgrade_database(url)
    assert tables(url) == TABLES


def test_migrations_upgrade_downgrade_upgrade_on_postgres(empty_postgres_url: str) -> None:
    assert_up_down_up(empty_postgres_url)


def test_migrations_upgrade_downgrade_upgrade_on_sqlite(tmp_path: Path) -> None:
    assert_up_down_up(f"sqlite:///{tmp_path / 'nested' / 'trainctl.db'}")


def fill_0003(url: str) -> None:
    """One run with an attempt, a metric point, an eval, a checkpoint and an outbox row, as a
    database at revision 0003 holds them."""
    engine = make_engine(url)
    now = "2026-11-30 12:00:00"
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO workflows (id, name, spec, created_at) "
                    "VALUES ('w1', 'w', '{}', :now)"
                ),
                {"now": now},
            )
            conn.execute(
                text(
                    "INSERT INTO runs (id, workflow_id, name, status, signature, "
                    "signature_components, plan, phase_index, step, total_steps, max_restarts, "
                    "max_preemptions, created_at, updated_at) VALUES ('run_1', 'w1', 'r', "
                    "'running', 's', '{}', '{}', 0, 4, 10, 3, 3, :now, :now)"
                ),
                {"now": now},
            )
            conn.execute(
                text(
                    "INSERT INTO attempts (id, run_id, number, phase_index, status, "
                    "fencing_token) VALUES ('att_1', 'run_1', 1, 0, 'running', 1)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
                    "VALUES ('run_1', 'loss', 4, 1.5, 'att_1')"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO evals (run_id, task, step, attempt_id, phase, cross_entropy, "
                    "perplexity, records, target_tokens, oversized_records) VALUES ('run_1', "
                    "'qa', 4, 'att_1', 'p', 1.0, 2.7, 3, 30, 0)"
                )
            )
            conn.execute(
                text(
                    "INSERT INTO checkpoints (run_id, attempt_id, step, phase_index, "
                    "phase_step, path, created_at) VALUES ('run_1', 'att_1', 4, 0, 4, "
                    "'/a/step-00000004', :now)"
                ),
                {"now": now},
            )
            conn.execute(
                text("INSERT INTO outbox (attempt_id, created_at) VALUES ('att_1', :now)"),
                {"now": now},
            )
    finally:
        engine.dispose()


def row_counts(url: str) -> dict[str, int]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return {
                table: int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
                for table in ("runs", "attempts", "metrics", "evals", "checkpoints", "outbox")
            }
    finally:
        engine.dispose()


EVAL_ROW = ("run_1", "qa", 4, "att_1", "p", 1.0, 2.7, 3, 30, 0)


def eval_rows(url: str, *, named: bool) -> list[tuple[object, ...]]:
    """The evals table's rows (with `name` last where the revision has it)."""
    columns = "run_id, task, step, attempt_id, phase, cross_entropy, perplexity, records, "
    columns += "target_tokens, oversized_records" + (", name" if named else "")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(f"SELECT {columns} FROM evals"))]
    finally:
        engine.dispose()


def test_upgrading_a_database_with_runs_keeps_every_row(empty_database_url: str) -> None:
    """0004 rebuilds the attempts table on SQLite; its rows and every row that references
    them (metrics, evals, checkpoints, outbox) must survive, there and back. 0005 keys evals
    by set name: an existing row keeps its data and is named after its task."""
    url = empty_database_url
    upgrade_database(url, "0003")
    fill_0003(url)
    before = row_counts(url)
    assert set(before.values()) == {1}
    assert eval_rows(url, named=False) == [EVAL_ROW]
    upgrade_database(url)
    assert row_counts(url) == before
    assert eval_rows(url, named=True) == [(*EVAL_ROW, "qa")]
    downgrade_database(url, "0003")
    assert row_counts(url) == before
    assert eval_rows(url, named=False) == [EVAL_ROW]
    upgrade_database(url)
    assert row_counts(url) == before
    assert eval_rows(url, named=True) == [(*EVAL_ROW, "qa")]


def test_eval_sets_of_one_task_are_kept_apart_and_downgrade_keeps_the_default_set(
    empty_database_url: str,
) -> None:
    url = empty_database_url
    upgrade_database(url, "0003")
    fill_0003(url)
    upgrade_database(url)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            for name, step, ce in (("qa-rag", 4, 5.0), ("a-mix", 8, 3.0), ("qa", 8, 2.0)):
                conn.execute(
                    text(
                        "INSERT INTO evals (run_id, name, task, step, attempt_id, phase, "
                        "cross_entropy, perplexity, records, target_tokens, oversized_records) "
                        "VALUES ('run_1', :name, 'qa', :step, 'att_1', 'p', :ce, 7.4, 1, 9, 0)"
                    ),
                    {"name": name, "step": step, "ce": ce},
                )
    finally:
        engine.dispose()
    assert row_counts(url)["evals"] == 4
    downgrade_database(url, "0004")
    # One row per (run, task, step): the set named after its task wins at steps 4 and 8.
    kept = sorted((row[2], row[5]) for row in eval_rows(url, named=False))
    assert kept == [(4, 1.0), (8, 2.0)]
