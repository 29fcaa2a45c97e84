"""add a table of workflow owners

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04

Workflows are content-addressed (one row per document), so a workflow has no one owner: two
users may store the same document. `workflow_owners` holds a row per (workflow, token) that
stored it (`POST /workflows`) or ran it (`POST /runs`); to a user token, `GET /workflows/{id}`
and `POST /runs {"workflow_id"}` reach only the workflows a row names for it.

The upgrade fills it from the runs: each run's owner owns its workflow. Who stored a workflow
without running it was never recorded, so such a workflow has no owner: admins and viewers see
it, no user does (as with runs from before migration 0010).

Downgrade drops the table: the workflows and their runs stay.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "workflow_owners",
        sa.Column("workflow_id", sa.String(64), nullable=False),
        sa.Column("owner_id", sa.String(32), nullable=False),
        sa.ForeignKeyConstraint(
            ["workflow_id"],
            ["workflows.id"],
            name=op.f("fk_workflow_owners_workflow_id_workflows"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("workflow_id", "owner_id", name=op.f("pk_workflow_owners")),
    )
    op.execute(
        "INSERT INTO workflow_owners (workflow_id, owner_id) "
        "SELECT DISTINCT workflow_id, owner_id FROM runs WHERE owner_id IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_table("workflow_owners")
