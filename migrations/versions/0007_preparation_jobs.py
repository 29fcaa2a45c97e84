"""add preparation jobs, and what an attempt is tokenizing before its first step

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06

- `jobs.kind` may be `preparation`: a data file's token store built ahead of time
  (POST /datasets/prepare).
- `attempts.preparing_file` and `preparing_fraction`: the data file an attempt is tokenizing
  into its store before its first step, and the share of it read, as its heartbeats say.

Downgrade deletes preparation jobs (and their outbox rows): the old check refuses them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_JOB_KINDS = "'inspection', 'evaluation'"
JOB_KINDS = "'inspection', 'evaluation', 'preparation'"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_jobs_kind"), f"kind IN ({JOB_KINDS})")
    with op.batch_alter_table("attempts") as batch:
        batch.add_column(sa.Column("preparing_file", sa.String(1024), nullable=True))
        batch.add_column(sa.Column("preparing_fraction", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("attempts") as batch:
        batch.drop_column("preparing_fraction")
        batch.drop_column("preparing_file")
    # Explicitly, not by the foreign key's cascade: SQLite migrates with foreign keys off.
    op.execute(
        "DELETE FROM outbox WHERE job_id IN (SELECT id FROM jobs WHERE kind = 'preparation')"
    )
    op.execute("DELETE FROM jobs WHERE kind = 'preparation'")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_jobs_kind"), f"kind IN ({OLD_JOB_KINDS})")
