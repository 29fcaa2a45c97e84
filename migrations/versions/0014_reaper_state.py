"""add the reaper's record of when a pass last heard the workers

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-10

`reaper_state` holds one row: when a reaper pass of any replica last reached the database
(`heard_at`). After a restart, an outage or a freeze, the reaper gives running leases back
the time since then that no pass heard, instead of a whole lease at every start, which let a
replica crash-looping faster than a lease keep a dead worker's lease alive for ever. The row
starts with NULL: the first pass after this revision does not know how long the service was
deaf and grants one lease, as before.

Downgrade drops the table; nothing else refers to it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    table = op.create_table(
        "reaper_state",
        sa.Column("id", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("heard_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reaper_state")),
    )
    op.bulk_insert(table, [{"id": 1, "heard_at": None}])


def downgrade() -> None:
    op.drop_table("reaper_state")
