"""add a note to runs and a table of run tags

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01

- `runs.note`: free text about a run (why it was started, what it showed), set with
  `PATCH /runs/{id}`; NULL for every run before this revision.
- `run_tags`: a row per (run, tag), deleted with its run. `ix_run_tags_tag_run_id` makes
  "the runs carrying this tag" one index range (`GET /runs?tag=...`).

Downgrade drops both: the runs themselves and everything else about them stay.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("note", sa.Text(), nullable=True))
    op.create_table(
        "run_tags",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("tag", sa.String(64), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_run_tags_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "tag", name=op.f("pk_run_tags")),
    )
    op.create_index("ix_run_tags_tag_run_id", "run_tags", ["tag", "run_id"])


def downgrade() -> None:
    op.drop_index("ix_run_tags_tag_run_id", table_name="run_tags")
    op.drop_table("run_tags")
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("note")
