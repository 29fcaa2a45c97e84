"""member claims of a phase across machines, and the address a worker advertises

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-04

Each member of an attempt across N workers claims its own part (service/workers/lease.py):

- `attempt_members.claim_nonce`, `claim_token_id`, `worker_hostname`, `worker_pid`: who claimed
  member k, so that its retried claim gets the same answer, its heartbeats and finish are
  fenced by its own worker token, and a lost member is named by its host and pid.
- `workers.address`: the host other workers reach this one at (its ping's `address`,
  TRAINCTL_ADVERTISE_ADDRESS, default its hostname); member 0's is the attempt's rendezvous.

All nullable, nothing to backfill; the downgrade drops them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempt_members") as batch:
        batch.add_column(sa.Column("claim_nonce", sa.String(64), nullable=True))
        batch.add_column(sa.Column("claim_token_id", sa.String(32), nullable=True))
        batch.add_column(sa.Column("worker_hostname", sa.String(255), nullable=True))
        batch.add_column(sa.Column("worker_pid", sa.Integer(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("address", sa.String(255), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("address")
    with op.batch_alter_table("attempt_members") as batch:
        batch.drop_column("worker_pid")
        batch.drop_column("worker_hostname")
        batch.drop_column("claim_token_id")
        batch.drop_column("claim_nonce")
