"""count an attempt's messages sent again and a job's deliveries; index the outbox by attempt

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04

- `attempts.redispatches`: how many times the reaper sent a queued attempt's message again
  because no worker claimed it within `TRAINCTL_REDISPATCH_SECONDS` while one was free (the
  broker lost it). 0 for every attempt before this revision.
- `jobs.deliveries`: how many times a job's message went out to the broker (its first send
  and every re-send after `TRAINCTL_JOB_TIMEOUT_SECONDS`); past `TRAINCTL_JOB_MAX_DELIVERIES`
  a job whose worker keeps dying fails. Jobs before this revision get the count of their
  outbox rows that were sent, which is what it counts.
- `ix_outbox_attempt_id`: the redispatch pass asks, for each queued attempt, when its last
  message went out; without the index each question reads the whole outbox, which keeps a
  row per message ever sent.

Downgrade drops the index and both columns; every attempt and job stays.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OUTBOX_ATTEMPT = "ix_outbox_attempt_id"


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(
            sa.Column("redispatches", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(
            sa.Column("deliveries", sa.Integer(), nullable=False, server_default=sa.text("0"))
        )
    op.execute(
        "UPDATE jobs SET deliveries = (SELECT count(*) FROM outbox "
        "WHERE outbox.job_id = jobs.id AND outbox.sent_at IS NOT NULL)"
    )
    op.create_index(_OUTBOX_ATTEMPT, "outbox", ["attempt_id"])


def downgrade() -> None:
    op.drop_index(_OUTBOX_ATTEMPT, table_name="outbox")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("deliveries")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("redispatches")
