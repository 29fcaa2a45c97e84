"""key evaluations by eval set name

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04

- `evals.name`: the eval set a result belongs to (the workflow's `evals[k].name`, by default
  its task). Existing rows get their task as their name, which is what their workflows'
  sets are called now. The primary key becomes (run_id, name, step), so two sets of one task
  (a QA mixture and a RAG set) keep their own results instead of overwriting each other.

Downgrade keys the table by (run_id, task, step) again and drops `name`. Where two sets of one
task have results at the same step, only one row per (run, task, step) can stay: the row of
the set whose name is the task is kept if there is one, else the first name in sort order;
the other sets' rows at that step are deleted.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("evals") as batch:
        batch.add_column(sa.Column("name", sa.String(200), nullable=True))
    op.execute("UPDATE evals SET name = task")
    with op.batch_alter_table("evals") as batch:
        batch.alter_column("name", existing_type=sa.String(200), nullable=False)
        batch.drop_constraint(op.f("pk_evals"), type_="primary")
        batch.create_primary_key(op.f("pk_evals"), ["run_id", "name", "step"])


def downgrade() -> None:
    # One row per (run, task, step) survives: the set named after its task, else the first.
    op.execute(
        """
        DELETE FROM evals WHERE EXISTS (
            SELECT 1 FROM evals AS kept
            WHERE kept.run_id = evals.run_id AND kept.task = evals.task
              AND kept.step = evals.step AND kept.name <> evals.name
              AND (
                CASE WHEN kept.name = kept.task THEN 0 ELSE 1 END,
                kept.name
              ) < (
                CASE WHEN evals.name = evals.task THEN 0 ELSE 1 END,
                evals.name
              )
        )
        """
    )
    with op.batch_alter_table("evals") as batch:
        batch.drop_constraint(op.f("pk_evals"), type_="primary")
        batch.create_primary_key(op.f("pk_evals"), ["run_id", "task", "step"])
        batch.drop_column("name")
