"""add run budgets and pause requests, and the paused attempt status

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Until now `runs.max_restarts` was the budget for preemptions and lost workers. It becomes the
budget for errors (cause `infrastructure`), and `max_preemptions` takes over its old meaning:
existing runs keep their budget under the new name, and their error budget is the old value
too (no existing run loses restarts it had).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Timestamp = sa.DateTime(timezone=True)

OLD_ATTEMPT_STATUSES = (
    "'queued', 'running', 'succeeded', 'failed', 'preempted', 'lost', 'superseded'"
)
NEW_ATTEMPT_STATUSES = (
    "'queued', 'running', 'succeeded', 'failed', 'preempted', 'paused', 'lost', 'superseded'"
)


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("max_preemptions", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("pause_requested_at", Timestamp, nullable=True))
    op.execute("UPDATE runs SET max_preemptions = max_restarts")
    with op.batch_alter_table("runs") as batch:
        batch.alter_column("max_preemptions", existing_type=sa.Integer(), nullable=False)
    with op.batch_alter_table("attempts") as batch:
        batch.drop_constraint(op.f("ck_attempts_status"), type_="check")
        batch.create_check_constraint(
            op.f("ck_attempts_status"), f"status IN ({NEW_ATTEMPT_STATUSES})"
        )


def downgrade() -> None:
    # A paused attempt ended without being preempted or failing: `superseded` says that.
    op.execute("UPDATE attempts SET status = 'superseded' WHERE status = 'paused'")
    with op.batch_alter_table("attempts") as batch:
        batch.drop_constraint(op.f("ck_attempts_status"), type_="check")
        batch.create_check_constraint(
            op.f("ck_attempts_status"), f"status IN ({OLD_ATTEMPT_STATUSES})"
        )
    # The preemption budget was the one max_restarts stood for.
    op.execute("UPDATE runs SET max_restarts = max_preemptions")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("pause_requested_at")
        batch.drop_column("max_preemptions")
