"""add per-claim secrets, claim nonces and progress to attempts, states to checkpoints, and
the workers table

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

- `attempts.fencing_token` was a counter that was always 1 after a claim; it becomes the
  claim's random secret, which every later report of the attempt must present. Attempts
  running across the upgrade lose theirs (their workers are of the old protocol and are
  refused anyway; the reaper recovers them from their latest checkpoint).
- `attempts.claim_nonce` and `claim_token_id`: who won the claim, so that the same claimant's
  retry gets the same claim back, and no other worker token may write to the attempt.
- `attempts.progress` and `progress_at`: what the worker last reported having done, and when
  that last moved; an attempt whose progress stalls is lost with cause `stalled`.
- `checkpoints.status` (`usable`, `deleted`, `quarantined`) and `reason`: the registry follows
  what workers delete or set aside on disk.
- `workers`: the workers the service has heard from.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Timestamp = sa.DateTime(timezone=True)

CHECKPOINT_STATUSES = "'usable', 'deleted', 'quarantined'"


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("fencing_token")
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("fencing_token", sa.String(64), nullable=True))
        batch.add_column(sa.Column("claim_nonce", sa.String(64), nullable=True))
        batch.add_column(sa.Column("claim_token_id", sa.String(32), nullable=True))
        batch.add_column(sa.Column("progress", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("progress_at", Timestamp, nullable=True))
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(
            sa.Column("status", sa.String(16), nullable=False, server_default="usable")
        )
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))
        batch.add_column(sa.Column("removed_at", Timestamp, nullable=True))
        batch.create_check_constraint(
            op.f("ck_checkpoints_status"), f"status IN ({CHECKPOINT_STATUSES})"
        )
    op.create_table(
        "workers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("queue", sa.String(200), nullable=True),
        sa.Column("token_id", sa.String(32), nullable=True),
        sa.Column("attempt_id", sa.String(32), nullable=True),
        sa.Column("first_seen_at", Timestamp, nullable=False),
        sa.Column("last_seen_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        sa.UniqueConstraint("hostname", "pid", name=op.f("uq_workers_hostname_pid")),
    )
    op.create_index("ix_workers_last_seen_at", "workers", ["last_seen_at"])


def downgrade() -> None:
    op.drop_index("ix_workers_last_seen_at", table_name="workers")
    op.drop_table("workers")
    # Deleted and quarantined checkpoints are not on disk as registered: forget them.
    op.execute("DELETE FROM checkpoints WHERE status <> 'usable'")
    with op.batch_alter_table("checkpoints") as batch:
        batch.drop_constraint(op.f("ck_checkpoints_status"), type_="check")
        batch.drop_column("removed_at")
        batch.drop_column("reason")
        batch.drop_column("status")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("progress_at")
        batch.drop_column("progress")
        batch.drop_column("claim_token_id")
        batch.drop_column("claim_nonce")
        batch.drop_column("fencing_token")
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(
            sa.Column("fencing_token", sa.Integer(), nullable=False, server_default="0")
        )
