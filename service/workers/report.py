"""Report ingestion: what a worker posts about its attempt (metric points, evaluations, checkpoint
registrations and removals) and how it ends (finish). Every report is fenced
(service.workers.lease): only the claimant, with the claim's secret, writes, and each accepted
report renews the lease.

One module, over 450 lines: every report is fenced and answered alike, and a reader follows one
from its route (service/api/routes/internal.py) to here; the metric batch's SQL on Postgres is a
third of it.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contracts.bounds import MAX_COUNT, MAX_NAME
from contracts.paths import RUNS_FOLDER
from contracts.reports import (
    CheckpointRemoval,
    CheckpointReport,
    EvalBatch,
    Finish,
    MetricBatch,
)
from contracts.reports import MetricPoint as ReportedPoint
from runtime.store import is_store_uri, join
from service.checkpoints.registry import CHECKPOINTS_DIR, kept_best, pins
from service.db import insert_for
from service.errors import ApiError
from service.lifecycle import (
    RETRIED_CAUSE,
    AttemptStatus,
    advance_run_step,
    end_attempt,
    set_run_step,
    settle_attempt,
)
from service.models import (
    ApiToken,
    Attempt,
    Checkpoint,
    EvalResult,
    MetricPoint,
    Run,
    utcnow,
)
from service.workers.lease import fence, fence_member, superseded


def checkpoint_path_of(artifact_root: str, run_id: str, step: int) -> str:
    """Where a run's checkpoint of `step` lives, as the worker writes it
    (`<artifact_root>/runs/<run_id>/checkpoints/step-NNNNNNNN`, a path or an object store's
    URI), judged on the text (the service need not see the artifact store)."""
    return normalized(join(artifact_root, RUNS_FOLDER, run_id, CHECKPOINTS_DIR, f"step-{step:08d}"))


def normalized(location: str) -> str:
    """A path or URI with `.`, `..` and doubled separators resolved in its text."""
    if is_store_uri(location):
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{posixpath.normpath(rest)}"
    return os.path.normpath(location)


def finite_or_none(value: float) -> float | None:
    """NaN and inf are stored as NULL: SQLite cannot store NaN, and JSON cannot say either."""
    return value if math.isfinite(value) else None


# The longest metric name the metrics table stores (MetricPoint.name).
MAX_METRIC_NAME = MAX_NAME


@dataclass(frozen=True)
class ItemError:
    """One refused item of a batch, by its index in the request."""

    index: int
    error: str


def point_error(point: ReportedPoint) -> str | None:
    """Why one metric point cannot be stored, or None. A non-finite value is refused (a NaN
    loss is the worker's to report as a failure with cause `nan`), not stored as a gap."""
    return name_error(point.name) or value_error(point.step, point.value)


def name_error(name: str) -> str | None:
    """Why a metric name cannot be stored, or None (point_error's first checks)."""
    if not name.strip():
        return "name is empty; name the metric (e.g. 'loss')"
    if "\0" in name:
        return "name contains a NUL character (U+0000), which cannot be stored"
    if len(name) > MAX_METRIC_NAME:
        return f"name is {len(name)} characters long; at most {MAX_METRIC_NAME} are stored"
    return None


def value_error(step: int, value: float) -> str | None:
    """Why a point's step or value cannot be stored, or None (point_error's last checks)."""
    if not 0 <= step <= MAX_COUNT:
        return f"step {step} is out of range; steps count from 0 to {MAX_COUNT}"
    if not math.isfinite(value):
        return f"value {value} at step {step} is not finite; only finite values are stored"
    return None


def record_metrics(
    *,
    session: Session,
    attempt_id: str,
    batch: MetricBatch,
    token: ApiToken,
    lease_seconds: float,
) -> tuple[int, list[ItemError]]:
    """Upsert points by (run, name, step): a resumed attempt's re-report wins, and a batch
    sent again (a retry after a timeout) rewrites the same rows. A point that cannot be
    stored is answered as an error with its index; the rest are stored. Returns (stored,
    errors)."""
    attempt = fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=batch.fencing_token,
        token=token,
        lease_seconds=lease_seconds,
    )
    errors: list[ItemError] = []
    # One statement may not touch a row twice (Postgres refuses); the batch's last value wins.
    latest: dict[tuple[str, int], float] = {}
    # A batch holds a few names many times over: each is checked once (point_error's order).
    names: dict[str, str | None] = {}
    for index, point in enumerate(batch.points):
        name, step, value = point.name, point.step, point.value
        if name not in names:
            names[name] = name_error(name)
        error = names[name]
        if error is None and (not 0 <= step <= MAX_COUNT or not math.isfinite(value)):
            error = value_error(step, value)
        if error is None:
            latest[(name, step)] = value
        else:
            errors.append(ItemError(index=index, error=error))
    if latest:
        _upsert_points(session, attempt, latest)
        advance_run_step(session, attempt.run_id, max(step for _, step in latest))
    session.commit()
    return len(batch.points) - len(errors), errors


# A batch on Postgres: one statement whatever its size, its points passed as one JSON text of
# three arrays, which Postgres parses (float8 from JSON's shortest repr is exact). As one
# INSERT ... VALUES of 1,000 rows (5,000 parameters) SQLAlchemy spent ~270 ms per batch
# compiling it (uncacheable: every batch is another statement); as an executemany ~45 ms; as
# three array parameters ~25 ms, of which psycopg's quoting of each array element ~5 ms.
_INSERT_JSON = (
    "INSERT INTO metrics (run_id, name, step, value, attempt_id) "
    "SELECT :run_id, point.name, point.step, point.value, :attempt_id "
    "FROM json_to_record(CAST(:points AS json)) "
    'AS batch(names varchar[], steps integer[], "values" double precision[]), '
    "unnest(batch.names, batch.steps, batch.values) AS point(name, step, value)"
)
# Nearly every batch holds new steps only: a plain INSERT takes it for ~0.7 of the upsert's
# time (Postgres's speculative insertion, row by row). A batch that meets a stored step (a
# resumed attempt re-reporting the steps after its checkpoint, a retried batch) is rolled back
# to its savepoint and upserted.
_PLAIN_INSERT = text(_INSERT_JSON)
_UPSERT_JSON = text(
    f"{_INSERT_JSON} ON CONFLICT (run_id, name, step) "
    "DO UPDATE SET value = excluded.value, attempt_id = excluded.attempt_id"
)


UNIQUE_VIOLATION = "23505"


def _upsert_points(
    session: Session, attempt: Attempt, points: dict[tuple[str, int], float]
) -> None:
    """Insert or overwrite `points` ((name, step) -> value, each key once, values finite)
    as the attempt's."""
    if session.get_bind().dialect.name == "postgresql":
        columns = {
            "names": [name for name, _ in points],
            "steps": [step for _, step in points],
            "values": list(points.values()),
        }
        values = {
            "run_id": attempt.run_id,
            "attempt_id": attempt.id,
            "points": json.dumps(columns, ensure_ascii=False, allow_nan=False),
        }
        try:
            with session.begin_nested():
                session.execute(_PLAIN_INSERT, values)
        except IntegrityError as err:
            if getattr(err.orig, "sqlstate", None) != UNIQUE_VIOLATION:
                raise
            session.execute(_UPSERT_JSON, values)
        return
    stmt = insert_for(session, MetricPoint.__table__)
    session.connection().execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "name", "step"],
            set_={"value": stmt.excluded.value, "attempt_id": stmt.excluded.attempt_id},
        ),
        [
            {"run_id": attempt.run_id, "name": n, "step": s, "value": v, "attempt_id": attempt.id}
            for (n, s), v in points.items()
        ],
    )


def record_evals(
    *,
    session: Session,
    attempt_id: str,
    batch: EvalBatch,
    token: ApiToken,
    lease_seconds: float,
) -> int:
    attempt = fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=batch.fencing_token,
        token=token,
        lease_seconds=lease_seconds,
    )
    latest = {(r.name, r.step): r for r in batch.results}
    if latest:
        stmt = insert_for(session, EvalResult).values(
            [
                {
                    "run_id": attempt.run_id,
                    "name": r.name,
                    "step": r.step,
                    "task": r.task,
                    "attempt_id": attempt.id,
                    "phase": r.phase,
                    "cross_entropy": finite_or_none(r.cross_entropy),
                    "perplexity": finite_or_none(r.perplexity),
                    "records": r.records,
                    "target_tokens": r.target_tokens,
                    "oversized_records": r.oversized_records,
                    "skipped_records": r.skipped_records,
                    "skipped_examples": r.skipped_examples,
                }
                for r in latest.values()
            ]
        )
        updated = (
            "task",
            "attempt_id",
            "phase",
            "cross_entropy",
            "perplexity",
            "records",
            "target_tokens",
            "oversized_records",
            "skipped_records",
            "skipped_examples",
        )
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "name", "step"],
                set_={column: stmt.excluded[column] for column in updated},
            )
        )
    session.commit()
    return len(batch.results)


def register_checkpoint(
    *,
    session: Session,
    attempt_id: str,
    report: CheckpointReport,
    token: ApiToken,
    lease_seconds: float,
    artifact_root: str,
) -> Checkpoint:
    """Record a complete checkpoint. The same step registered again (a resumed attempt writing
    it anew) replaces the earlier entry. It must be this attempt's: its path the step's own
    directory in the run's checkpoint directory (`checkpoint_path_of`; 422
    `invalid_checkpoint_path` otherwise, since the service hands registered paths to later
    attempts and to other runs as initial checkpoints), its phase the attempt's and its step
    inside that phase (422 `invalid_checkpoint`)."""
    attempt = fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=report.fencing_token,
        token=token,
        lease_seconds=lease_seconds,
    )
    ref = report.checkpoint
    expected = checkpoint_path_of(artifact_root, attempt.run_id, ref.step)
    if normalized(ref.path) != expected:
        session.rollback()
        raise ApiError(
            422,
            "invalid_checkpoint_path",
            f"checkpoint.path: {ref.path!r} is not the directory of step {ref.step} in this "
            f"run's checkpoints, {str(expected)!r}; a worker writes checkpoints there only",
            {"field": "checkpoint.path", "path": ref.path, "expected": str(expected)},
        )
    run = session.get(Run, attempt.run_id)
    assert run is not None
    phase = run.plan["phases"][attempt.phase_index]
    first, last = int(phase["first_step"]), int(phase["last_step"])
    inside = ref.phase_index == attempt.phase_index and first <= ref.step <= last
    if not inside or ref.phase_step != ref.step - first + 1:
        session.rollback()
        raise ApiError(
            422,
            "invalid_checkpoint",
            f"checkpoint: step {ref.step} (phase {ref.phase_index}, phase step "
            f"{ref.phase_step}) is not a step of this attempt's phase {attempt.phase_index}, "
            f"which covers steps {first}..{last} (phase steps 1..{last - first + 1})",
            {"field": "checkpoint", "first_step": first, "last_step": last},
        )
    stmt = insert_for(session, Checkpoint).values(
        run_id=attempt.run_id,
        attempt_id=attempt.id,
        step=ref.step,
        phase_index=ref.phase_index,
        phase_step=ref.phase_step,
        path=ref.path,
        created_at=utcnow(),
        # Written anew: usable again, whatever became of the directory it replaced.
        status="usable",
        reason=None,
        removed_at=None,
    )
    updated = ("attempt_id", "phase_index", "phase_step", "path", "created_at")
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "step"],
            set_={
                column: stmt.excluded[column]
                for column in (*updated, "status", "reason", "removed_at")
            },
        )
    )
    advance_run_step(session, attempt.run_id, ref.step)
    session.commit()
    checkpoint = session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == attempt.run_id, Checkpoint.step == ref.step)
    ).one()
    return checkpoint


def _unverified_finish(attempt: Attempt, message: str) -> ApiError:
    return ApiError(
        409,
        "unverified_finish",
        f"attempt {attempt.id} (run {attempt.run_id}, number {attempt.number}) reports "
        f"success, but {message}; the attempt stays running (report the phase's final "
        "checkpoint, then finish again)",
        {"attempt_id": attempt.id},
    )


def verify_success(*, session: Session, run: Run, attempt: Attempt, step: int) -> None:
    """A `succeeded` finish is believed only when it is true: the step is the phase's last,
    and that step's checkpoint is registered and usable (the next phase starts from it).
    409 `unverified_finish` otherwise."""
    last = int(run.plan["phases"][attempt.phase_index]["last_step"])
    if step != last:
        raise _unverified_finish(attempt, f"step {step} is not the last step of its phase ({last})")
    final = session.scalars(
        select(Checkpoint).where(
            Checkpoint.run_id == run.id,
            Checkpoint.step == last,
            Checkpoint.status == "usable",
        )
    ).one_or_none()
    if final is None:
        raise _unverified_finish(
            attempt, f"no usable checkpoint of its final step {last} is registered"
        )


def finish_attempt(
    *, session: Session, attempt_id: str, report: Finish, token: ApiToken, lease_seconds: float
) -> Attempt | None:
    """End an attempt and move the run on (service.lifecycle.settle_attempt). A `succeeded`
    finish is verified first (verify_success). Returns the new attempt, if any, whose outbox
    row the caller dispatches after this commit. A member k > 0 of an attempt across many
    workers says how its part ended (`finish_member`)."""
    if report.member > 0:
        return finish_member(session=session, attempt_id=attempt_id, report=report, token=token)
    now = utcnow()
    attempt = fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=report.fencing_token,
        token=token,
        lease_seconds=lease_seconds,
    )
    run = session.get(Run, attempt.run_id, with_for_update=True)
    assert run is not None
    if report.status == AttemptStatus.SUCCEEDED:
        try:
            verify_success(session=session, run=run, attempt=attempt, step=report.step)
        except ApiError:
            session.rollback()
            raise
    failed = report.status == AttemptStatus.FAILED
    end_attempt(
        attempt,
        AttemptStatus(report.status),
        now=now,
        cause=(report.cause or RETRIED_CAUSE) if failed else None,
        message=report.message,
    )
    set_run_step(run, report.step)
    next_attempt = settle_attempt(session=session, run=run, attempt=attempt, now=now)
    session.commit()
    return next_attempt


def finish_member(
    *, session: Session, attempt_id: str, report: Finish, token: ApiToken
) -> Attempt | None:
    """Member k > 0 of an attempt across many workers ends its part. Only a failure is news
    (member 0 finishes the attempt when the phase ends well, and says so): it fails the whole
    attempt with the member's cause (default `infrastructure`) and message, prefixed with
    which member, and the run is settled as for any failed attempt (an infrastructure failure
    recovers from the latest checkpoint while `max_restarts` lasts). The other members then
    hear `stop`. Another status is 422 `invalid_finish`; a stale secret 409 `superseded` (the
    attempt already ended: the first member to fail, or the reaper, named the cause)."""
    if report.status != AttemptStatus.FAILED:
        raise ApiError(
            422,
            "invalid_finish",
            f"member {report.member} of attempt {attempt_id} finished {report.status!r}: a "
            "member other than 0 may only finish 'failed' (member 0 finishes the attempt)",
            {"attempt_id": attempt_id, "member": report.member, "status": report.status},
        )
    now = utcnow()
    _, row = fence_member(
        session=session,
        attempt_id=attempt_id,
        member=report.member,
        fencing_token=report.fencing_token,
        token=token,
    )
    attempt = session.get(Attempt, attempt_id, with_for_update=True, populate_existing=True)
    assert attempt is not None
    if attempt.status != AttemptStatus.RUNNING or attempt.fencing_token != report.fencing_token:
        session.rollback()
        raise superseded(attempt)
    run = session.get(Run, attempt.run_id, with_for_update=True)
    assert run is not None
    where = f"member {row.member} of {attempt.nodes} ({row.worker_hostname}, pid {row.worker_pid})"
    end_attempt(
        attempt,
        AttemptStatus.FAILED,
        now=now,
        cause=report.cause or RETRIED_CAUSE,
        message=f"{where}: {report.message or 'failed'}",
    )
    next_attempt = settle_attempt(session=session, run=run, attempt=attempt, now=now)
    session.commit()
    return next_attempt


def remove_checkpoint(
    *,
    session: Session,
    attempt_id: str,
    removal: CheckpointRemoval,
    token: ApiToken,
    lease_seconds: float,
) -> Checkpoint | None:
    """Record that the worker of `attempt_id` deleted or quarantined its run's checkpoint at
    `removal.step`. Fenced like every report (and renews the lease). A step the registry does
    not hold (a dead attempt's leftover that was never registered) changes nothing: None. A
    deletion of a pinned checkpoint (another run may start from it, or it is the best of a set
    the run's `checkpoint.keep_best` names) is 409 `checkpoint_pinned` and changes nothing
    either; a quarantine is always recorded (the files are unusable whoever needs them)."""
    attempt = fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=removal.fencing_token,
        token=token,
        lease_seconds=lease_seconds,
    )
    checkpoint = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.run_id == attempt.run_id, Checkpoint.step == removal.step)
        .with_for_update()
    ).one_or_none()
    if checkpoint is None:
        session.commit()  # the lease renewal
        return None
    if removal.status == "deleted":
        needed_by = pins(session=session, run_id=attempt.run_id).get(removal.step, [])
        if needed_by:
            session.rollback()
            raise _pinned(checkpoint, needed_by)
        best_of = kept_best(session=session, run_id=attempt.run_id).get(removal.step, [])
        if best_of:
            session.rollback()
            raise _kept_best(checkpoint, best_of)
    checkpoint.status = removal.status
    checkpoint.reason = removal.reason
    checkpoint.removed_at = utcnow()
    session.commit()
    return checkpoint


def _kept_best(checkpoint: Checkpoint, sets: list[str]) -> ApiError:
    named = ", ".join(repr(s) for s in sets)
    return ApiError(
        409,
        "checkpoint_pinned",
        f"step {checkpoint.step}: the checkpoint {checkpoint.path} of run {checkpoint.run_id} is "
        f"the best checkpoint of eval set(s) {named}, which its workflow's checkpoint.keep_best "
        "keeps while the run exists (the answer to each checkpoint registration lists the "
        "pinned steps)",
        {"run_id": checkpoint.run_id, "step": checkpoint.step, "best_of": sets},
    )


def _pinned(checkpoint: Checkpoint, needed_by: list[str]) -> ApiError:
    runs = ", ".join(needed_by)
    return ApiError(
        409,
        "checkpoint_pinned",
        f"step {checkpoint.step}: the checkpoint {checkpoint.path} of run {checkpoint.run_id} "
        f"is the initial checkpoint or pretrained model of run(s) {runs}, which may still start "
        "from it (not succeeded, no checkpoint of their own yet); retention must keep it while "
        "they need it (the answer to each checkpoint registration lists the pinned steps)",
        {"run_id": checkpoint.run_id, "step": checkpoint.step, "pinned_by": needed_by},
    )
