"""The database tables, as SQLAlchemy 2 typed mappings. The schema itself is made by Alembic
(migrations/); these classes must stay in step with the latest revision.

Types are portable (JSON, not JSONB) so one migration runs on Postgres and on SQLite.

Every table is here, over 450 lines: the schema is read whole beside the migrations that make
it, and a table split from the others would hide the keys and constraints between them.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, get_args

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from contracts.api import TokenRole
from contracts.bounds import (
    MAX_HOSTNAME,
    MAX_ID,
    MAX_NAME,
    MAX_PATH,
    MAX_TAG,
    MAX_TASK,
    SHA256_HEX,
)
from contracts.jobs import JobKind, JobStatus

# The statuses' check constraints. The statuses themselves, their transitions and every write
# of them live in service/lifecycle.py (which imports this module, so it cannot be imported
# here); tests/unit/service/test_lifecycle.py keeps the two equal.
RUN_STATUSES = ("queued", "running", "recovering", "paused", "succeeded", "failed", "cancelled")
ATTEMPT_STATUSES = (
    "queued",
    "running",
    "succeeded",
    "failed",
    "preempted",
    "paused",
    "lost",
    "superseded",
)

JOB_KINDS: tuple[str, ...] = get_args(JobKind)
JOB_STATUSES: tuple[str, ...] = get_args(JobStatus)
FINISHED_JOB_STATUSES = ("succeeded", "failed")

CheckpointStatus = Literal["usable", "deleted", "quarantined"]
CHECKPOINT_STATUSES: tuple[str, ...] = get_args(CheckpointStatus)

# admin: everything, tokens included; user: creates runs and jobs, reads and controls its own;
# viewer: reads everything, changes nothing; worker: the internal API only (service.access).
TOKEN_ROLES: tuple[str, ...] = get_args(TokenRole)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_run_id() -> str:
    return f"run_{secrets.token_hex(6)}"


def new_attempt_id() -> str:
    return f"att_{secrets.token_hex(6)}"


def new_job_id() -> str:
    return f"job_{secrets.token_hex(6)}"


def new_token_id() -> str:
    return f"tok_{secrets.token_hex(6)}"


def _one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class UtcDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC on the way in and out; SQLite drops the zone, so it is put back."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}; use service.models.utcnow()")
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: UtcDateTime(),
        dict[str, Any]: JSON(),
    }


class Workflow(Base):
    """A normalised workflow document, addressed by the SHA-256 of its canonical JSON."""

    __tablename__ = "workflows"

    id: Mapped[str] = mapped_column(String(SHA256_HEX), primary_key=True)
    name: Mapped[str] = mapped_column(String(MAX_NAME))
    spec: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class WorkflowOwner(Base):
    """A token that stored or ran a workflow (POST /workflows, POST /runs). Workflows are
    content-addressed, one row per document, so two owners may hold the same one: to a user
    token, a workflow is its own when a row names it (service.runs.workflow.get_workflow)."""

    __tablename__ = "workflow_owners"

    workflow_id: Mapped[str] = mapped_column(
        ForeignKey("workflows.id", ondelete="CASCADE"), primary_key=True
    )
    owner_id: Mapped[str] = mapped_column(String(MAX_ID), primary_key=True)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        CheckConstraint(_one_of("status", RUN_STATUSES), name="status"),
        Index("ix_runs_created_at", "created_at"),
        Index("ix_runs_status", "status"),
        Index("ix_runs_owner_id_created_at", "owner_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(MAX_ID), primary_key=True, default=new_run_id)
    workflow_id: Mapped[str] = mapped_column(ForeignKey("workflows.id"))
    name: Mapped[str] = mapped_column(String(MAX_NAME))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    cause: Mapped[str | None] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text)
    signature: Mapped[str] = mapped_column(String(64))
    signature_components: Mapped[dict[str, Any]]
    plan: Mapped[dict[str, Any]]
    initial_checkpoint: Mapped[str | None] = mapped_column(Text)
    phase_index: Mapped[int] = mapped_column(default=0)
    step: Mapped[int] = mapped_column(default=0)
    total_steps: Mapped[int]
    idempotency_key: Mapped[str | None] = mapped_column(String(MAX_NAME), unique=True)
    # SHA-256 of the request that used idempotency_key: the same key with another body is a
    # conflict, not a replay.
    request_sha256: Mapped[str | None] = mapped_column(String(64))
    # Budgets, counted from the run's attempts (service.lifecycle.budget_use): errors with cause
    # `infrastructure` against max_restarts; preemptions and lost workers against
    # max_preemptions. Other causes (data, nan, oom, config, ...) are never retried blindly.
    max_restarts: Mapped[int]
    max_preemptions: Mapped[int]
    # Set by POST /runs/{id}/pause while a worker runs the attempt: its heartbeats answer
    # "pause" until it finishes `paused`. Cleared when the run is resumed.
    pause_requested_at: Mapped[datetime | None]
    # The id of the token that created the run (service.access stamps it); NULL for runs
    # created before owners were recorded (migration 0010), which only admins and viewers see.
    owner_id: Mapped[str | None] = mapped_column(String(32))
    # The device count the run was last resumed with (POST /runs/{id}/resume `devices`): every
    # later attempt, of this phase and the next ones, runs on it. None: as the workflow asks
    # (contracts.workflow.Workflow.phase_devices).
    devices: Mapped[int | None]
    # Placement order (service.workers.scheduler): higher first; PATCH /runs/{id} changes it.
    priority: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    # Free text about the run, for people (PATCH /runs/{id}); its tags are rows of RunTag.
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)
    finished_at: Mapped[datetime | None]


class RunTag(Base):
    """One tag of a run (PATCH /runs/{id} replaces the set). Keyed by (run, tag); the index on
    (tag, run) makes `GET /runs?tag=...` one range."""

    __tablename__ = "run_tags"
    __table_args__ = (Index("ix_run_tags_tag_run_id", "tag", "run_id"),)

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(MAX_TAG), primary_key=True)


class Attempt(Base):
    """One try at one phase of a run. Claimed by exactly one worker (conditional UPDATE); every
    report after the claim carries `fencing_token`, the claim's random secret, so a superseded
    or foreign worker cannot write."""

    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("run_id", "number"),
        CheckConstraint(_one_of("status", ATTEMPT_STATUSES), name="status"),
        Index("ix_attempts_status_lease", "status", "lease_expires_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_attempt_id)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int]
    phase_index: Mapped[int]
    # The torch.distributed ranks it runs on, fixed when it is queued (service.lifecycle.
    # attempt_devices); its message goes to that count's queue (contracts.dispatch).
    devices: Mapped[int] = mapped_column(default=1, server_default=text("1"))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    # The claim's secret (None until claimed); every report must present it.
    fencing_token: Mapped[str | None] = mapped_column(String(64))
    # Who won the claim: a retry with the same nonce gets the same claim back, and reports
    # from any other worker token are refused.
    claim_nonce: Mapped[str | None] = mapped_column(String(64))
    claim_token_id: Mapped[str | None] = mapped_column(String(32))
    # What the worker last said it had done (a counter that only grows while it works), and
    # when that last moved: an attempt whose progress stalls is lost with cause `stalled`.
    progress: Mapped[int | None] = mapped_column(BigInteger)
    progress_at: Mapped[datetime | None]
    # The data file the attempt is tokenizing into its store before its first step, and the
    # share read (heartbeats).
    preparing_file: Mapped[str | None] = mapped_column(String(1024))
    preparing_fraction: Mapped[float | None] = mapped_column(Float)
    worker_hostname: Mapped[str | None] = mapped_column(String(MAX_HOSTNAME))
    worker_pid: Mapped[int | None]
    # No foreign key: attempts and checkpoints would reference each other, and SQLite cannot
    # add the second constraint after both tables exist.
    resume_checkpoint_id: Mapped[int | None]
    claimed_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    lease_expires_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    cause: Mapped[str | None] = mapped_column(String(32))
    message: Mapped[str | None] = mapped_column(Text)
    # How many times its message was sent again while it stayed queued: no worker claimed it
    # within TRAINCTL_REDISPATCH_SECONDS though one was free (service.workers.dispatch
    # .redispatch_unclaimed).
    redispatches: Mapped[int] = mapped_column(default=0, server_default=text("0"))
    # When it was queued: placement order within a priority (service.workers.scheduler).
    queued_at: Mapped[datetime | None] = mapped_column(default=utcnow)
    # The workers it runs on at once (a gang; attempt_members has one row per member).
    nodes: Mapped[int] = mapped_column(default=1, server_default=text("1"))
    # Why it still waits, as the last placement pass saw it (None once placed).
    waiting_reason: Mapped[str | None] = mapped_column(Text)
    # The service asked it to checkpoint and yield to a higher priority (its heartbeat answers
    # "pause"; its run is queued again on its own, never charged to max_preemptions).
    yield_requested_at: Mapped[datetime | None]


class AttemptMember(Base):
    """Member k of an attempt, placed on the worker whose key is `worker_id` (its own queue,
    contracts.dispatch.worker_queue). An attempt is placed when its rows exist: all members
    together, in the placement pass's transaction. claimed_at and heartbeat_at are the member's
    own claim and last heartbeat (member claims of a multi-node phase)."""

    __tablename__ = "attempt_members"
    __table_args__ = (Index("ix_attempt_members_worker_id", "worker_id"),)

    attempt_id: Mapped[str] = mapped_column(
        ForeignKey("attempts.id", ondelete="CASCADE"), primary_key=True
    )
    member: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    worker_id: Mapped[str] = mapped_column(String(200))
    placed_at: Mapped[datetime] = mapped_column(default=utcnow)
    claimed_at: Mapped[datetime | None]
    heartbeat_at: Mapped[datetime | None]
    # Who claimed member k (migration 0020): its retried claim (same nonce, same token) gets
    # the same answer; its heartbeats and finish must come with this token.
    claim_nonce: Mapped[str | None] = mapped_column(String(64))
    claim_token_id: Mapped[str | None] = mapped_column(String(32))
    worker_hostname: Mapped[str | None] = mapped_column(String(MAX_HOSTNAME))
    worker_pid: Mapped[int | None]


class SchedulerState(Base):
    """One row (`id` 1), updated first by every placement pass: the UPDATE's lock (a row lock
    on Postgres, the write lock on SQLite) makes replicas' passes take turns."""

    __tablename__ = "scheduler_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    passes: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))


class Checkpoint(Base):
    """A complete checkpoint, registered by the worker after its manifest was written. Its
    status follows the disk: a worker reports what retention deleted and what verification
    quarantined; only `usable` ones are listed by default or resumed from."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "step"),
        CheckConstraint(_one_of("status", CHECKPOINT_STATUSES), name="status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[str] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int]
    phase_index: Mapped[int]
    phase_step: Mapped[int]
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    status: Mapped[str] = mapped_column(String(16), default="usable", server_default="usable")
    reason: Mapped[str | None] = mapped_column(Text)  # why it was deleted or quarantined
    removed_at: Mapped[datetime | None]


class MetricPoint(Base):
    """One training metric value. A resumed attempt re-reports steps after its checkpoint; the
    latest report wins (upsert on the primary key)."""

    __tablename__ = "metrics"
    __table_args__ = (
        # Thinned reads (service.reads.series.thin_series): the points whose step is a multiple of
        # 2^k, for any k, are one range of this index, ordered by (run, name, largest power of
        # two dividing the step). `value` rides along so Postgres answers from the index alone.
        Index(
            "ix_metrics_step_level",
            "run_id",
            "name",
            text("(step & (- step))"),  # as Postgres writes it back, for the drift check
            "step",
            postgresql_include=["value"],
        ),
    )

    # No foreign keys: a trigger and a lookup per row were most of an ingest's cost (migration
    # 0013). A batch is written only after its attempt was found and locked
    # (service.workers.lease.fence), and a trigger on `runs` deletes a run's points with it.
    run_id: Mapped[str] = mapped_column(String(MAX_ID), primary_key=True)
    name: Mapped[str] = mapped_column(String(MAX_NAME), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True)
    # Non-finite points are refused per item (service.workers.report.point_error); NULL is left only
    # in rows stored before that, when NaN and inf were kept as NULL.
    value: Mapped[float | None] = mapped_column(Float)
    attempt_id: Mapped[str] = mapped_column(String(MAX_ID))


class EvalResult(Base):
    """One eval set's evaluation at one step: token-weighted, target-only cross-entropy. A set
    is keyed by its name (default: its task), so two sets of one task keep their own rows."""

    __tablename__ = "evals"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(MAX_NAME), primary_key=True)
    step: Mapped[int] = mapped_column(primary_key=True)
    task: Mapped[str] = mapped_column(String(MAX_TASK))
    attempt_id: Mapped[str] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    phase: Mapped[str] = mapped_column(String(MAX_NAME))
    cross_entropy: Mapped[float | None] = mapped_column(Float)
    perplexity: Mapped[float | None] = mapped_column(Float)
    records: Mapped[int]
    target_tokens: Mapped[int]
    oversized_records: Mapped[int] = mapped_column(default=0)
    # The records the set skipped as unscorable, by reason (contracts.reports.SKIP_REASONS),
    # and the first few as "file:line: reason" (migration 0017).
    skipped_records: Mapped[dict[str, Any]] = mapped_column(default=dict, server_default="{}")
    skipped_examples: Mapped[list[str]] = mapped_column(JSON, default=list, server_default="[]")


class Job(Base):
    """Work that is not training (contracts.jobs): a dataset inspection or a standalone
    evaluation, run by a worker, its outcome posted back."""

    __tablename__ = "jobs"
    __table_args__ = (
        CheckConstraint(_one_of("kind", JOB_KINDS), name="kind"),
        CheckConstraint(_one_of("status", JOB_STATUSES), name="status"),
        Index("ix_jobs_created_at", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_job_id)
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    # The request with its paths resolved (contracts.jobs.InspectRequest or EvaluateRequest).
    request: Mapped[dict[str, Any]]
    # An InspectionReport or a contracts.reports.EvalResult, once succeeded.
    result: Mapped[dict[str, Any] | None]
    error: Mapped[str | None] = mapped_column(Text)
    # The token that created the job, as for runs (Run.owner_id).
    owner_id: Mapped[str | None] = mapped_column(String(32))
    # The worker token that last started it: its outcome must come from that token.
    claim_token_id: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    # How many times its message went out to the broker (service.workers.dispatch.dispatch_pending):
    # the first send, and each one after a worker went silent on it. Past
    # TRAINCTL_JOB_MAX_DELIVERIES it fails (service.workers.job.fail_exhausted_jobs).
    deliveries: Mapped[int] = mapped_column(default=0, server_default=text("0"))


class InputDigest(Base):
    """The content digest of an object store input (a run's tokenizer, data, pretrained model or
    initial checkpoint at an `s3://` URI), which the service never downloads: keyed by the URI
    and the fingerprint of its objects (contracts.jobs.object_fingerprint: keys, ETags and sizes
    from a HEAD or a listing), hashed by a worker's `digest` job (service.runs.digest). A row
    without sha256 is waiting for its job."""

    __tablename__ = "input_digests"

    uri: Mapped[str] = mapped_column(String(MAX_PATH), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(SHA256_HEX), primary_key=True)
    sha256: Mapped[str | None] = mapped_column(String(SHA256_HEX))
    # Bytes hashed, over every object (once hashed).
    size: Mapped[int | None] = mapped_column(BigInteger)
    # The digest job hashing it; NULL once that job is gone (then it is asked again).
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="SET NULL"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    hashed_at: Mapped[datetime | None]


class OutboxMessage(Base):
    """A Celery message still to send (sent_at NULL) or already sent. Written in the same
    transaction as its attempt or job, so a crash between commit and send loses nothing.
    Exactly one of attempt_id and job_id is set."""

    __tablename__ = "outbox"
    __table_args__ = (
        Index("ix_outbox_sent_at", "sent_at"),
        # When an attempt's last message went out (service.workers.dispatch.redispatch_unclaimed).
        Index("ix_outbox_attempt_id", "attempt_id"),
        CheckConstraint("(attempt_id IS NULL) <> (job_id IS NULL)", name="one_target"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    attempt_id: Mapped[str | None] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    sent_at: Mapped[datetime | None]
    # A placed attempt's message goes to its worker's own queue, as member `member` (None: one
    # member, sent without it). None for jobs, which go to the base queue.
    queue: Mapped[str | None] = mapped_column(String(300))
    member: Mapped[int | None]


class ApiToken(Base):
    """A bearer token, stored as its SHA-256 only. Rows are never deleted: a revoked token
    keeps its row (its runs keep their owner, the audit trail its name). Rotation replaces the
    hash under the same id, so what the token owns stays its own."""

    __tablename__ = "api_tokens"
    __table_args__ = (CheckConstraint(_one_of("role", TOKEN_ROLES), name="role"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True, default=new_token_id)
    name: Mapped[str] = mapped_column(String(200))
    role: Mapped[str] = mapped_column(String(16))
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    rotated_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    # The most devices this owner's attempts may hold placed or running at once (None:
    # unlimited): `trainctl tokens create --max-devices`, PATCH /tokens/{id}.
    max_devices: Mapped[int | None]


class AuditEvent(Base):
    """One change made through the API or `trainctl tokens` (service.audit): who (the token's
    id, name and role at the time), what (`action`, the target's id), when and from where (the
    client's address). Written in the transaction of the change it records."""

    __tablename__ = "audit_events"
    __table_args__ = (
        Index("ix_audit_events_action_id", "action", "id"),
        Index("ix_audit_events_target_id_id", "target_id", "id"),
    )

    # Newest first is by id (GET /audit pages by it).
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow)
    action: Mapped[str] = mapped_column(String(32))
    target_id: Mapped[str | None] = mapped_column(String(MAX_ID))
    actor_token_id: Mapped[str | None] = mapped_column(String(32))
    actor_name: Mapped[str] = mapped_column(String(200))
    actor_role: Mapped[str | None] = mapped_column(String(16))
    client_address: Mapped[str | None] = mapped_column(String(MAX_HOSTNAME))
    details: Mapped[dict[str, Any] | None]


class Worker(Base):
    """A worker process the service has heard from (a claim, a heartbeat or its own ping),
    keyed by hostname and pid."""

    __tablename__ = "workers"
    __table_args__ = (
        UniqueConstraint("hostname", "pid"),
        Index("ix_workers_last_seen_at", "last_seen_at"),
        Index("ix_workers_key", "key", unique=True),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hostname: Mapped[str] = mapped_column(String(MAX_HOSTNAME))
    pid: Mapped[int]
    version: Mapped[str] = mapped_column(String(64))
    queue: Mapped[str | None] = mapped_column(String(200))
    token_id: Mapped[str | None] = mapped_column(String(32))
    attempt_id: Mapped[str | None] = mapped_column(String(32))  # the attempt it works on
    # What its ping says it can run a phase on: `devices` of `device_kind` ("cpu", "cuda").
    # None for a worker heard from only by its claims, which counts as one device.
    devices: Mapped[int | None]
    device_kind: Mapped[str | None] = mapped_column(String(16))
    # Its own queue's key (contracts.dispatch.worker_queue), from its ping; None for a worker
    # heard from only by its claims, which cannot be placed on.
    key: Mapped[str | None] = mapped_column(String(200))
    # The host other workers reach it at (its ping's `address`; None: its hostname): member
    # 0's is the rendezvous of an attempt across machines.
    address: Mapped[str | None] = mapped_column(String(MAX_HOSTNAME))
    first_seen_at: Mapped[datetime] = mapped_column(default=utcnow)
    last_seen_at: Mapped[datetime] = mapped_column(default=utcnow)


class ReaperState(Base):
    """One row (`id` 1): when a reaper pass of any replica last reached the database
    (`heard_at`, by the database's clock). A pass that owes grace gives running leases back
    the time since then that no pass heard (service/workers/reaper.py); NULL: none ever did."""

    __tablename__ = "reaper_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    heard_at: Mapped[datetime | None]
