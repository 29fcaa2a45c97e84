"""add jobs, and let an outbox row carry a job instead of an attempt

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

Jobs (dataset inspections, standalone evaluations) are sent to workers through the same
outbox as attempts: a row now names exactly one of an attempt or a job.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

Timestamp = sa.DateTime(timezone=True)

JOB_KINDS = "'inspection', 'evaluation'"
JOB_STATUSES = "'queued', 'running', 'succeeded', 'failed'"
ONE_TARGET = "(attempt_id IS NULL) <> (job_id IS NULL)"


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("started_at", Timestamp, nullable=True),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.CheckConstraint(f"kind IN ({JOB_KINDS})", name=op.f("ck_jobs_kind")),
        sa.CheckConstraint(f"status IN ({JOB_STATUSES})", name=op.f("ck_jobs_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index("ix_jobs_created_at", "jobs", ["created_at"])
    with op.batch_alter_table("outbox") as batch:
        batch.alter_column("attempt_id", existing_type=sa.String(32), nullable=True)
        batch.add_column(sa.Column("job_id", sa.String(32), nullable=True))
        batch.create_foreign_key(
            op.f("fk_outbox_job_id_jobs"), "jobs", ["job_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_check_constraint(op.f("ck_outbox_one_target"), ONE_TARGET)


def downgrade() -> None:
    # A job's message has no place in the old outbox; the jobs themselves go with their table.
    op.execute("DELETE FROM outbox WHERE job_id IS NOT NULL")
    with op.batch_alter_table("outbox") as batch:
        batch.drop_constraint(op.f("ck_outbox_one_target"), type_="check")
        batch.drop_constraint(op.f("fk_outbox_job_id_jobs"), type_="foreignkey")
        batch.drop_column("job_id")
        batch.alter_column("attempt_id", existing_type=sa.String(32), nullable=False)
    op.drop_index("ix_jobs_created_at", table_name="jobs")
    op.drop_table("jobs")
