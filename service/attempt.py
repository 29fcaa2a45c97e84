"""The worker protocol: claim an attempt, report on it, finish it.

Each state change that can race is one conditional UPDATE whose row count says who won: a claim
wins only on a queued attempt; a report counts only while the attempt is running under the
reporter's fencing token. Every accepted report also renews the lease.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from contracts.reports import (
    CheckpointRef,
    CheckpointReport,
    Claim,
    ClaimRequest,
    EvalBatch,
    Finish,
    Heartbeat,
    HeartbeatAnswer,
    MetricBatch,
)
from contracts.signature import Digests
from service.checkpoint import latest_checkpoint
from service.db import insert_for, rowcount
from service.errors import ApiError, not_found
from service.models import (
    FINISHED_RUN_STATUSES,
    Attempt,
    Checkpoint,
    EvalResult,
    MetricPoint,
    OutboxMessage,
    Run,
    Workflow,
    new_attempt_id,
    utcnow,
)

_STOP_HINT = "stop now and write nothing more; the run is owned by a newer attempt or ended"


def restarts_used(attempts: Iterable[Attempt]) -> int:
    """Attempts beyond the first of each phase: each one is a restart."""
    attempts = list(attempts)
    return len(attempts) - len({a.phase_index for a in attempts})


def finite_or_none(value: float) -> float | None:
    """NaN and inf are stored as NULL: SQLite cannot store NaN, and JSON cannot say either."""
    return value if math.isfinite(value) else None


def digests_of(components: dict[str, Any]) -> Digests:
    """The digests a run was signed with, from its stored signature components."""
    initial = components.get("initial_checkpoint")
    pretrained = components.get("pretrained")
    return Digests(
        tokenizer=components["tokenizer"]["sha256"],
        data={path: entry["sha256"] for path, entry in components["data"].items()},
        initial_checkpoint=None if initial is None else initial["sha256"],
        pretrained=None if pretrained is None else pretrained["sha256"],
    )


def add_attempt(*, session: Session, run: Run, phase_index: int) -> Attempt:
    """A queued attempt (next number) plus its outbox row. Does not commit: the caller's
    transaction makes both visible together, and the dispatcher sends after the commit."""
    last = session.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run.id))
    attempt = Attempt(
        id=new_attempt_id(),
        run_id=run.id,
        number=(last or 0) + 1,
        phase_index=phase_index,
        status="queued",
        fencing_token=0,
    )
    session.add(attempt)
    session.flush()
    session.add(OutboxMessage(attempt_id=attempt.id))
    session.flush()
    return attempt


def _lease_end(now: datetime, lease_seconds: float) -> datetime:
    return now + timedelta(seconds=lease_seconds)


def lease_expired(attempt: Attempt, now: datetime) -> bool:
    """A running attempt whose worker has not renewed its lease in time (killed, cut off)."""
    return (
        attempt.status == "running"
        and attempt.lease_expires_at is not None
        and attempt.lease_expires_at <= now
    )


def is_active(attempt: Attempt, now: datetime) -> bool:
    """Waiting for a worker, or owned by one whose lease still holds."""
    return attempt.status == "queued" or (
        attempt.status == "running" and not lease_expired(attempt, now)
    )


def expire_attempt(*, session: Session, attempt: Attempt, now: datetime) -> bool:
    """Mark a running attempt whose lease expired `lost`, in one conditional UPDATE: a report
    that renewed the lease (or a finish) in the meantime wins, and this answers False. The
    worker, if it still lives, is then refused as superseded. Does not commit."""
    expired_at = attempt.lease_expires_at
    result = session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt.id,
            Attempt.status == "running",
            Attempt.fencing_token == attempt.fencing_token,
            Attempt.lease_expires_at <= now,
        )
        .values(
            status="lost",
            finished_at=now,
            cause="infrastructure",
            message=(
                f"lost: its worker ({attempt.worker_hostname}, pid {attempt.worker_pid}) sent "
                f"no report before its lease expired at {expired_at:%Y-%m-%d %H:%M:%S} UTC"
                if expired_at is not None
                else "lost: it held no lease"
            ),
        )
        .execution_options(synchronize_session=False)
    )
    won = rowcount(result) == 1
    session.refresh(attempt)
    return won


def _get_attempt(session: Session, attempt_id: str) -> Attempt:
    attempt = session.get(Attempt, attempt_id, populate_existing=True)
    if attempt is None:
        raise not_found("attempt", attempt_id, "drop this message: no such attempt exists")
    return attempt


def _superseded(attempt: Attempt, fencing_token: int | None) -> ApiError:
    token = "" if fencing_token is None else f", your fencing token {fencing_token}"
    return ApiError(
        409,
        "superseded",
        f"attempt {attempt.id} (run {attempt.run_id}, number {attempt.number}) is {attempt.status}"
        f" with fencing token {attempt.fencing_token}{token}; {_STOP_HINT}",
        {
            "attempt_id": attempt.id,
            "status": attempt.status,
            "fencing_token": attempt.fencing_token,
        },
    )


def _fence(
    *, session: Session, attempt_id: str, fencing_token: int, lease_seconds: float, **values: Any
) -> Attempt:
    """Check that the attempt is running under `fencing_token`, renew its lease and apply
    `values`, in one conditional UPDATE. On Postgres the row stays locked until commit, so a
    report and a concurrent finish (or reaper) serialise. 409 `superseded` otherwise."""
    now = utcnow()
    result = session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt_id,
            Attempt.status == "running",
            Attempt.fencing_token == fencing_token,
        )
        .values(heartbeat_at=now, lease_expires_at=_lease_end(now, lease_seconds), **values)
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        raise _superseded(_get_attempt(session, attempt_id), fencing_token)
    return _get_attempt(session, attempt_id)


def _is_current(session: Session, attempt: Attempt) -> bool:
    if attempt.status in ("superseded", "lost"):
        return False
    newest = session.scalar(
        select(func.max(Attempt.number)).where(Attempt.run_id == attempt.run_id)
    )
    return newest == attempt.number


def claim_attempt(
    *,
    session: Session,
    attempt_id: str,
    request: ClaimRequest,
    lease_seconds: float,
    artifact_root: Path,
) -> Claim:
    """Exactly one claimant of a queued attempt wins; the others get 409 `already_claimed`
    (or `superseded` when the attempt is no longer the run's current one)."""
    now = utcnow()
    result = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.status == "queued")
        .values(
            status="running",
            fencing_token=Attempt.fencing_token + 1,
            worker_hostname=request.hostname,
            worker_pid=request.pid,
            claimed_at=now,
            heartbeat_at=now,
            lease_expires_at=_lease_end(now, lease_seconds),
        )
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        attempt = _get_attempt(session, attempt_id)
        if not _is_current(session, attempt):
            raise _superseded(attempt, None)
        raise ApiError(
            409,
            "already_claimed",
            f"attempt {attempt.id} was already claimed by {attempt.worker_hostname} "
            f"(pid {attempt.worker_pid}) at {attempt.claimed_at} and is {attempt.status}; drop "
            "this message: messages may be delivered twice, work happens once",
            {"attempt_id": attempt.id, "status": attempt.status},
        )

    attempt = _get_attempt(session, attempt_id)
    run = session.get(Run, attempt.run_id, with_for_update=True)
    assert run is not None
    if run.status in (*FINISHED_RUN_STATUSES, "paused"):
        attempt.status = "superseded"
        attempt.finished_at = now
        session.commit()
        raise _superseded(attempt, None)
    workflow = session.get(Workflow, run.workflow_id)
    assert workflow is not None
    resume = latest_checkpoint(session=session, run_id=run.id)
    attempt.resume_checkpoint_id = None if resume is None else resume.id
    run.status = "running"
    run.phase_index = attempt.phase_index
    session.commit()
    return Claim(
        attempt_id=attempt.id,
        run_id=run.id,
        attempt_number=attempt.number,
        fencing_token=attempt.fencing_token,
        lease_seconds=lease_seconds,
        workflow=workflow.spec,
        signature=run.signature,
        digests=digests_of(run.signature_components),
        initial_checkpoint=run.initial_checkpoint,
        phase_index=attempt.phase_index,
        resume_from=None if resume is None else _checkpoint_ref(resume),
        artifact_dir=str(artifact_root / "runs" / run.id),
    )


def _checkpoint_ref(checkpoint: Checkpoint) -> CheckpointRef:
    return CheckpointRef(
        path=checkpoint.path,
        step=checkpoint.step,
        phase_index=checkpoint.phase_index,
        phase_step=checkpoint.phase_step,
    )


def heartbeat(
    *, session: Session, attempt_id: str, report: Heartbeat, lease_seconds: float
) -> HeartbeatAnswer:
    """Renew the lease and record progress. A heartbeat is how a worker learns it must stop:
    a stale token or an attempt that is no longer running answers `stop`, not an error."""
    try:
        attempt = _fence(
            session=session,
            attempt_id=attempt_id,
            fencing_token=report.fencing_token,
            lease_seconds=lease_seconds,
        )
    except ApiError as err:
        if err.code == "superseded":
            return HeartbeatAnswer(action="stop", lease_seconds=lease_seconds)
        raise
    run = session.get(Run, attempt.run_id)
    assert run is not None
    if run.status in (*FINISHED_RUN_STATUSES, "paused"):
        session.rollback()
        return HeartbeatAnswer(action="stop", lease_seconds=lease_seconds)
    # The running attempt's step is the truth, even when lower (it resumed from a checkpoint).
    run.step = report.step
    session.commit()
    return HeartbeatAnswer(action="continue", lease_seconds=lease_seconds)


def _advance_step(session: Session, run_id: str, step: int) -> None:
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.step < step)
        .values(step=step, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )


def record_metrics(
    *, session: Session, attempt_id: str, batch: MetricBatch, lease_seconds: float
) -> int:
    """Upsert points by (run, name, step): a resumed attempt's re-report wins."""
    attempt = _fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=batch.fencing_token,
        lease_seconds=lease_seconds,
    )
    # One statement may not touch a row twice (Postgres refuses); the batch's last value wins.
    latest = {(p.name, p.step): p.value for p in batch.points}
    if latest:
        stmt = insert_for(session, MetricPoint).values(
            [
                {
                    "run_id": attempt.run_id,
                    "name": name,
                    "step": step,
                    "value": finite_or_none(value),
                    "attempt_id": attempt.id,
                }
                for (name, step), value in latest.items()
            ]
        )
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "name", "step"],
                set_={"value": stmt.excluded.value, "attempt_id": stmt.excluded.attempt_id},
            )
        )
        _advance_step(session, attempt.run_id, max(step for _, step in latest))
    session.commit()
    return len(batch.points)


def record_evals(
    *, session: Session, attempt_id: str, batch: EvalBatch, lease_seconds: float
) -> int:
    attempt = _fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=batch.fencing_token,
        lease_seconds=lease_seconds,
    )
    latest = {(r.task, r.step): r for r in batch.results}
    if latest:
        stmt = insert_for(session, EvalResult).values(
            [
                {
                    "run_id": attempt.run_id,
                    "task": r.task,
                    "step": r.step,
                    "attempt_id": attempt.id,
                    "phase": r.phase,
                    "cross_entropy": finite_or_none(r.cross_entropy),
                    "perplexity": finite_or_none(r.perplexity),
                    "records": r.records,
                    "target_tokens": r.target_tokens,
                    "oversized_records": r.oversized_records,
                }
                for r in latest.values()
            ]
        )
        updated = (
            "attempt_id",
            "phase",
            "cross_entropy",
            "perplexity",
            "records",
            "target_tokens",
            "oversized_records",
        )
        session.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "task", "step"],
                set_={column: stmt.excluded[column] for column in updated},
            )
        )
    session.commit()
    return len(batch.results)


def register_checkpoint(
    *, session: Session, attempt_id: str, report: CheckpointReport, lease_seconds: float
) -> Checkpoint:
    """Record a complete checkpoint. The same step registered again (a resumed attempt writing
    it anew) replaces the earlier entry."""
    attempt = _fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=report.fencing_token,
        lease_seconds=lease_seconds,
    )
    ref = report.checkpoint
    stmt = insert_for(session, Checkpoint).values(
        run_id=attempt.run_id,
        attempt_id=attempt.id,
        step=ref.step,
        phase_index=ref.phase_index,
        phase_step=ref.phase_step,
        path=ref.path,
        created_at=utcnow(),
    )
    session.execute(
        stmt.on_conflict_do_update(
            index_elements=["run_id", "step"],
            set_={
                column: stmt.excluded[column]
                for column in ("attempt_id", "phase_index", "phase_step", "path", "created_at")
            },
        )
    )
    _advance_step(session, attempt.run_id, ref.step)
    session.commit()
    checkpoint = session.scalars(
        select(Checkpoint).where(Checkpoint.run_id == attempt.run_id, Checkpoint.step == ref.step)
    ).one()
    return checkpoint


def finish_attempt(
    *, session: Session, attempt_id: str, report: Finish, lease_seconds: float
) -> Attempt | None:
    """End an attempt and move the run on: the next phase, success, failure, or a restart after
    a preemption (while the run's restart budget lasts). Returns the new attempt, if any, whose
    outbox row the caller dispatches after this commit."""
    now = utcnow()
    attempt = _fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=report.fencing_token,
        lease_seconds=lease_seconds,
        status=report.status,
        finished_at=now,
        cause=(report.cause or "infrastructure") if report.status == "failed" else None,
        message=report.message,
    )
    run = session.get(Run, attempt.run_id, with_for_update=True)
    assert run is not None
    run.step = report.step
    phases = run.plan["phases"]
    phase_name = phases[attempt.phase_index]["name"]
    next_attempt = None

    if report.status == "succeeded":
        if attempt.phase_index + 1 < len(phases):
            run.phase_index = attempt.phase_index + 1
            next_attempt = add_attempt(session=session, run=run, phase_index=run.phase_index)
        else:
            run.status, run.finished_at = "succeeded", now
    elif report.status == "failed":
        run.status, run.finished_at = "failed", now
        # A worker that cannot say why it failed: from here, that is an infrastructure failure.
        run.cause = report.cause or "infrastructure"
        run.message = (
            f"attempt {attempt.number} failed in phase {phase_name!r} at step {report.step}: "
            f"{report.message or 'the worker gave no reason'}"
        )
    else:
        used = restarts_used(session.scalars(select(Attempt).where(Attempt.run_id == run.id)))
        if used < run.max_restarts:
            run.status = "recovering"
            run.message = (
                f"attempt {attempt.number} was preempted in phase {phase_name!r} at step "
                f"{report.step}; restart {used + 1} of {run.max_restarts}"
            )
            next_attempt = add_attempt(session=session, run=run, phase_index=attempt.phase_index)
        else:
            run.status, run.finished_at, run.cause = "failed", now, "restarts_exhausted"
            run.message = (
                f"attempt {attempt.number} was preempted in phase {phase_name!r} at step "
                f"{report.step} and the run has used all {run.max_restarts} restarts "
                "(max_restarts); submit it again with a larger max_restarts, or resume it"
            )
    session.commit()
    return next_attempt
