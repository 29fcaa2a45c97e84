"""count the records an evaluation skipped, by reason

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04

An eval set skips the records it cannot score instead of failing its run: too long (counted in
`evals.oversized_records`, as before), and now also lines that are not JSON, records of the
wrong shape for the task and records without target tokens.

- `evals.skipped_records`: JSON, those counts by reason (`{"malformed_json": 1}`); `{}` for
  every existing row, which was evaluated before such records could be skipped (a run then
  failed on them).
- `evals.skipped_examples`: JSON, the first few skipped records as "file:line: reason"; `[]`.

Downgrade drops both columns; every evaluation stays, with its scored and oversized counts.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("evals") as batch:
        batch.add_column(
            sa.Column("skipped_records", sa.JSON(), nullable=False, server_default="{}")
        )
        batch.add_column(
            sa.Column("skipped_examples", sa.JSON(), nullable=False, server_default="[]")
        )


def downgrade() -> None:
    with op.batch_alter_table("evals") as batch:
        batch.drop_column("skipped_examples")
        batch.drop_column("skipped_records")
