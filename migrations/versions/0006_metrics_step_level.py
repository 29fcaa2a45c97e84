"""index metric points by the largest power of two dividing their step

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05

`ix_metrics_step_level` on (run_id, name, step & -step, step), with `value` included on
Postgres: a series thinned to a stride 2^k (GET /runs/{id}/metrics?max_points=...) is one range
of it, so the read costs the points it returns instead of the points the run stored. Building it
reads the whole table once; on a large Postgres table create it beforehand with CREATE INDEX
CONCURRENTLY under this name, and this migration finds it.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_metrics_step_level",
        "metrics",
        ["run_id", "name", sa.text("(step & -step)"), "step"],
        postgresql_include=["value"],
        if_not_exists=True,
    )


def downgrade() -> None:
    op.drop_index("ix_metrics_step_level", table_name="metrics")
