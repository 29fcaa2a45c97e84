"""add device counts: per attempt, a run's resumed override, and what each worker owns

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01

- `attempts.devices`: the torch.distributed ranks the attempt runs on (its message goes to
  the queue of that many devices, contracts.dispatch.devices_queue). Attempts made before
  this revision ran on one, which is what the server default gives them.
- `runs.devices`: the device count the run was last resumed with (`POST /runs/{id}/resume`
  `devices`), overriding the workflow's for every later attempt; NULL: as the workflow asks.
- `workers.devices` and `workers.device_kind`: what a worker's ping says it can run a phase
  on; NULL for a worker heard from only by its claims (counted as one device).

Downgrade drops the four columns: every attempt then reads as one device again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(
            sa.Column("devices", sa.Integer(), nullable=False, server_default=sa.text("1"))
        )
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("devices", sa.Integer(), nullable=True))
    with op.batch_alter_table("workers") as batch:
        batch.add_column(sa.Column("devices", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("device_kind", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch:
        batch.drop_column("device_kind")
        batch.drop_column("devices")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("devices")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("devices")
