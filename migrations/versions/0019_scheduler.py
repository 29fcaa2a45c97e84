"""the service places attempts: priorities, quotas, members, yields by priority

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-04

The service places each queued attempt on specific live workers (service/workers/placement.py)
instead of leaving it to whichever worker takes the next message.

- `runs.priority`: higher is placed first (default 0).
- `api_tokens.max_devices`: an owner's cap on devices placed or running at once (NULL:
  unlimited).
- `attempts.queued_at` (placement order within a priority; existing rows get their run's
  updated_at), `attempts.nodes` (workers of a gang), `attempts.waiting_reason` (why a queued
  attempt waits, as the last placement pass saw it), `attempts.yield_requested_at` (the service
  asked it to checkpoint and yield to a higher priority).
- `attempt_members`: (attempt, member k) -> the worker key it was placed on, when; claimed_at
  and heartbeat_at for member claims.
- `workers.key`: the worker's own queue's key (`<queue>.worker.<key>`), from its ping.
- `outbox.queue`, `outbox.member`: where a placed attempt's message goes, and which member.
- `scheduler_state`: one row, updated first by every placement pass so two replicas' passes
  take turns (a row lock on Postgres, the write lock on SQLite).

Downgrade drops all of it; attempts still queued are sent to the devices queues again by the
old code's outbox rows (none are missing: every placed attempt kept its row).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("max_devices", sa.Integer(), nullable=True))
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("queued_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("nodes", sa.Integer(), nullable=False, server_default="1"))
        batch.add_column(sa.Column("waiting_reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("yield_requested_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(
        "UPDATE attempts SET queued_at = (SELECT runs.updated_at FROM runs "
        "WHERE runs.id = attempts.run_id)"
    )
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("key", sa.String(200), nullable=True))
        batch.create_index("ix_workers_key", ["key"], unique=True)
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(sa.Column("queue", sa.String(300), nullable=True))
        batch.add_column(sa.Column("member", sa.Integer(), nullable=True))
    op.create_table(
        "attempt_members",
        sa.Column("attempt_id", sa.String(32), nullable=False),
        sa.Column("member", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(200), nullable=False),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_attempt_members_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("attempt_id", "member", name=op.f("pk_attempt_members")),
    )
    op.create_index("ix_attempt_members_worker_id", "attempt_members", ["worker_id"])
    table = op.create_table(
        "scheduler_state",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("passes", sa.BigInteger(), nullable=False, server_default="0"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_scheduler_state")),
    )
    op.bulk_insert(table, [{"id": 1, "passes": 0}])


def downgrade() -> None:
    op.drop_table("scheduler_state")
    op.drop_index("ix_attempt_members_worker_id", table_name="attempt_members")
    op.drop_table("attempt_members")
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("member")
        batch.drop_column("queue")
    with op.batch_alter_table("workers") as batch:
        batch.drop_index("ix_workers_key")
        batch.drop_column("key")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("yield_requested_at")
        batch.drop_column("waiting_reason")
        batch.drop_column("nodes")
        batch.drop_column("queued_at")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("max_devices")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("priority")
