"""add token roles user and viewer, revocation and rotation, run and job owners, audit events

Revision ID: 0010
Revises: 0007
Create Date: 2026-12-01

- `api_tokens.role` may be `user` (creates runs and jobs; reads and controls its own) or
  `viewer` (reads everything, changes nothing); `rotated_at` and `revoked_at`: a revoked token
  is refused, its row kept (its runs keep their owner, the audit trail its name).
- `runs.owner_id` and `jobs.owner_id`: the id of the token that created them. Rows made before
  this revision keep NULL: no user token owns them, so only admin and viewer tokens see them.
- `jobs.claim_token_id`: the worker token that last started a job; its outcome must come from
  that token.
- `audit_events`: who changed what, when and from where (service.audit).

Downgrade drops the audit trail and the owners, and deletes user and viewer tokens (the old
check refuses them).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_ROLES = "'admin', 'worker'"
ROLES = "'admin', 'user', 'viewer', 'worker'"


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_constraint(op.f("ck_api_tokens_role"), type_="check")
        batch.create_check_constraint(op.f("ck_api_tokens_role"), f"role IN ({ROLES})")
        batch.add_column(sa.Column("rotated_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner_id", sa.String(32), nullable=True))
        batch.create_index("ix_runs_owner_id_created_at", ["owner_id", "created_at"])
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("owner_id", sa.String(32), nullable=True))
        batch.add_column(sa.Column("claim_token_id", sa.String(32), nullable=True))
    op.create_table(
        "audit_events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target_id", sa.String(32), nullable=True),
        sa.Column("actor_token_id", sa.String(32), nullable=True),
        sa.Column("actor_name", sa.String(200), nullable=False),
        sa.Column("actor_role", sa.String(16), nullable=True),
        sa.Column("client_address", sa.String(255), nullable=True),
        sa.Column("details", sa.JSON(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_events")),
    )
    op.create_index("ix_audit_events_action_id", "audit_events", ["action", "id"])
    op.create_index("ix_audit_events_target_id_id", "audit_events", ["target_id", "id"])


def downgrade() -> None:
    op.drop_index("ix_audit_events_target_id_id", table_name="audit_events")
    op.drop_index("ix_audit_events_action_id", table_name="audit_events")
    op.drop_table("audit_events")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("claim_token_id")
        batch.drop_column("owner_id")
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_owner_id_created_at")
        batch.drop_column("owner_id")
    op.execute("DELETE FROM api_tokens WHERE role NOT IN ('admin', 'worker')")
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_column("revoked_at")
        batch.drop_column("rotated_at")
        batch.drop_constraint(op.f("ck_api_tokens_role"), type_="check")
        batch.create_check_constraint(op.f("ck_api_tokens_role"), f"role IN ({OLD_ROLES})")
