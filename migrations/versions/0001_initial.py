"""create workflows, runs, attempts, checkpoints, metrics, evals, outbox, tokens

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the types at this revision: a migration never imports the live models.
Timestamp = sa.DateTime(timezone=True)

RUN_STATUSES = "'queued', 'running', 'recovering', 'paused', 'succeeded', 'failed', 'cancelled'"
ATTEMPT_STATUSES = "'queued', 'running', 'succeeded', 'failed', 'preempted', 'lost', 'superseded'"


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("token_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.CheckConstraint("role IN ('admin', 'worker')", name=op.f("ck_api_tokens_role")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
        sa.UniqueConstraint("token_sha256", name=op.f("uq_api_tokens_token_sha256")),
    )
    op.create_table(
        "workflows",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workflows")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("workflow_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("cause", sa.String(32), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("signature", sa.String(64), nullable=False),
        sa.Column("signature_components", sa.JSON(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=False),
        sa.Column("initial_checkpoint", sa.Text(), nullable=True),
        sa.Column("phase_index", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=False),
        sa.Column("idempotency_key", sa.String(200), nullable=True),
        sa.Column("request_sha256", sa.String(64), nullable=True),
        sa.Column("max_restarts", sa.Integer(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("updated_at", Timestamp, nullable=False),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.CheckConstraint(f"status IN ({RUN_STATUSES})", name=op.f("ck_runs_status")),
        sa.ForeignKeyConstraint(
            ["workflow_id"], ["workflows.id"], name=op.f("fk_runs_workflow_id_workflows")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_runs_idempotency_key")),
    )
    op.create_index("ix_runs_created_at", "runs", ["created_at"])
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_table(
        "attempts",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("phase_index", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("fencing_token", sa.Integer(), nullable=False),
        sa.Column("worker_hostname", sa.String(255), nullable=True),
        sa.Column("worker_pid", sa.Integer(), nullable=True),
        sa.Column("resume_checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("claimed_at", Timestamp, nullable=True),
        sa.Column("heartbeat_at", Timestamp, nullable=True),
        sa.Column("lease_expires_at", Timestamp, nullable=True),
        sa.Column("finished_at", Timestamp, nullable=True),
        sa.Column("cause", sa.String(32), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.CheckConstraint(f"status IN ({ATTEMPT_STATUSES})", name=op.f("ck_attempts_status")),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_attempts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_attempts")),
        sa.UniqueConstraint("run_id", "number", name=op.f("uq_attempts_run_id_number")),
    )
    op.create_index("ix_attempts_status_lease", "attempts", ["status", "lease_expires_at"])
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("attempt_id", sa.String(32), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("phase_index", sa.Integer(), nullable=False),
        sa.Column("phase_step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_checkpoints_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "step", name=op.f("uq_checkpoints_run_id_step")),
    )
    op.create_table(
        "evals",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("task", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("attempt_id", sa.String(32), nullable=False),
        sa.Column("phase", sa.String(200), nullable=False),
        sa.Column("cross_entropy", sa.Float(), nullable=True),
        sa.Column("perplexity", sa.Float(), nullable=True),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("target_tokens", sa.Integer(), nullable=False),
        sa.Column("oversized_records", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_evals_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_evals_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "task", "step", name=op.f("pk_evals")),
    )
    op.create_table(
        "metrics",
        sa.Column("run_id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("attempt_id", sa.String(32), nullable=False),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_metrics_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_metrics_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "name", "step", name=op.f("pk_metrics")),
    )
    op.create_table(
        "outbox",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("attempt_id", sa.String(32), nullable=False),
        sa.Column("created_at", Timestamp, nullable=False),
        sa.Column("sent_at", Timestamp, nullable=True),
        sa.ForeignKeyConstraint(
            ["attempt_id"],
            ["attempts.id"],
            name=op.f("fk_outbox_attempt_id_attempts"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_outbox")),
    )
    op.create_index("ix_outbox_sent_at", "outbox", ["sent_at"])


def downgrade() -> None:
    op.drop_index("ix_outbox_sent_at", table_name="outbox")
    op.drop_table("outbox")
    op.drop_table("metrics")
    op.drop_table("evals")
    op.drop_table("checkpoints")
    op.drop_index("ix_attempts_status_lease", table_name="attempts")
    op.drop_table("attempts")
    op.drop_index("ix_runs_status", table_name="runs")
    op.drop_index("ix_runs_created_at", table_name="runs")
    op.drop_table("runs")
    op.drop_table("workflows")
    op.drop_table("api_tokens")
