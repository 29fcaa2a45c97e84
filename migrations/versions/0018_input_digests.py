"""record the digests of object store inputs, hashed by workers' digest jobs

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04

A run's inputs may be objects in an S3-compatible store (`s3://bucket/key`, a file, or a
prefix, a directory), which the service never downloads: a worker hashes them (a `digest` job)
and the service keeps the digest under what identifies the bytes short of reading them.

- `input_digests`: (uri, fingerprint) -> sha256, size, the job hashing it, when it was hashed.
  The fingerprint is contracts.jobs.object_fingerprint over the objects' keys, ETags and sizes.
- `jobs.kind` may be `digest`.

Downgrade drops the table and deletes digest jobs (and their outbox rows): the old check
refuses them. The digests are only a cache: the next run over those objects hashes them again.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_JOB_KINDS = "'inspection', 'evaluation', 'preparation'"
JOB_KINDS = "'inspection', 'evaluation', 'preparation', 'digest'"


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_jobs_kind"), f"kind IN ({JOB_KINDS})")
    op.create_table(
        "input_digests",
        sa.Column("uri", sa.String(1024), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=True),
        sa.Column("job_id", sa.String(32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hashed_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_input_digests_job_id_jobs"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("uri", "fingerprint", name=op.f("pk_input_digests")),
    )


def downgrade() -> None:
    op.drop_table("input_digests")
    # Explicitly, not by the foreign key's cascade: SQLite migrates with foreign keys off.
    op.execute("DELETE FROM outbox WHERE job_id IN (SELECT id FROM jobs WHERE kind = 'digest')")
    op.execute("DELETE FROM jobs WHERE kind = 'digest'")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_constraint(op.f("ck_jobs_kind"), type_="check")
        batch.create_check_constraint(op.f("ck_jobs_kind"), f"kind IN ({OLD_JOB_KINDS})")
