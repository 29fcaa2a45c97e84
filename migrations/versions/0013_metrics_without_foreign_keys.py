"""drop the metric table's foreign keys; delete a run's points with it by a trigger

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-02

Metric points are the one table written at the rate of training: every step of every run. Its
two foreign keys (to `runs` and `attempts`) cost a trigger and a locking lookup per row, and
measured here they were most of an ingest: Postgres took 42,000 rows/s by COPY with them and
110,000 without (bench/metrics_reads.py). What they guarded is guarded where the points are
written: a batch is stored only after `service.workers.lease.fence` has found and locked its running
attempt (and so its run) in the same transaction.

What they also did, delete a run's points with the run, a trigger on `runs` does now (once per
statement on Postgres, per row on SQLite). Attempts are deleted only with their run.

Downgrade deletes points whose run or attempt is gone, then restores both keys.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_RUN_FK = "fk_metrics_run_id_runs"
_ATTEMPT_FK = "fk_metrics_attempt_id_attempts"
_STEP_LEVEL = "ix_metrics_step_level"

_PG_FUNCTION = """
CREATE FUNCTION metrics_delete_with_runs() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM metrics WHERE run_id IN (SELECT id FROM deleted_runs);
    RETURN NULL;
END
$$
"""
_PG_TRIGGER = (
    "CREATE TRIGGER metrics_follow_runs AFTER DELETE ON runs "
    "REFERENCING OLD TABLE AS deleted_runs FOR EACH STATEMENT "
    "EXECUTE FUNCTION metrics_delete_with_runs()"
)
_SQLITE_TRIGGER = (
    "CREATE TRIGGER metrics_follow_runs AFTER DELETE ON runs "
    "BEGIN DELETE FROM metrics WHERE run_id = OLD.id; END"
)


def _step_level_index() -> None:
    # SQLite's batch copy cannot reflect an expression index and leaves it behind.
    op.create_index(
        _STEP_LEVEL,
        "metrics",
        ["run_id", "name", sa.text("(step & -step)"), "step"],
        postgresql_include=["value"],
        if_not_exists=True,
    )


def upgrade() -> None:
    with op.batch_alter_table("metrics") as batch:
        batch.drop_constraint(_RUN_FK, type_="foreignkey")
        batch.drop_constraint(_ATTEMPT_FK, type_="foreignkey")
    _step_level_index()
    if op.get_bind().dialect.name == "postgresql":
        op.execute(_PG_FUNCTION)
        op.execute(_PG_TRIGGER)
    else:
        op.execute(_SQLITE_TRIGGER)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS metrics_follow_runs" + _on_runs())
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS metrics_delete_with_runs()")
    op.execute(
        "DELETE FROM metrics WHERE run_id NOT IN (SELECT id FROM runs) "
        "OR attempt_id NOT IN (SELECT id FROM attempts)"
    )
    with op.batch_alter_table("metrics") as batch:
        batch.create_foreign_key(_RUN_FK, "runs", ["run_id"], ["id"], ondelete="CASCADE")
        batch.create_foreign_key(
            _ATTEMPT_FK, "attempts", ["attempt_id"], ["id"], ondelete="CASCADE"
        )
    _step_level_index()


def _on_runs() -> str:
    return " ON runs" if op.get_bind().dialect.name == "postgresql" else ""
