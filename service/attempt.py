"""The worker protocol: claim an attempt, report on it, finish it.

Each state change that can race is one conditional UPDATE whose row count says who won: a claim
wins only on a queued attempt; a report counts only while the attempt is running under the
reporter's fencing token. Every accepted report also renews the lease.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select, update
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
from contracts.reports import MetricPoint as ReportedPoint
from contracts.signature import Digests
from contracts.workflow import MAX_COUNT
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

# The one error cause retried blindly (a new attempt while max_restarts lasts): the machine or
# the network failed, not the run. data, config, nan, oom and signature_mismatch would fail the
# same way again.
RETRIED_CAUSE = "infrastructure"
# Attempt ends that count against max_preemptions: the worker was taken away.
PREEMPTION_STATUSES = ("preempted", "lost")


@dataclass(frozen=True)
class BudgetUse:
    """What a run's attempts used of its budgets. Derived from the attempts each time (never
    a stored counter that could drift from them)."""

    restarts: int  # attempts failed with cause `infrastructure` (max_restarts)
    preemptions: int  # attempts preempted or lost (max_preemptions)


def budget_use(attempts: Iterable[Attempt]) -> BudgetUse:
    restarts = preemptions = 0
    for attempt in attempts:
        if attempt.status == "failed" and attempt.cause == RETRIED_CAUSE:
            restarts += 1
        elif attempt.status in PREEMPTION_STATUSES:
            preemptions += 1
    return BudgetUse(restarts=restarts, preemptions=preemptions)


def recovery_seconds(attempts: Iterable[Attempt], now: datetime) -> float:
    """Time lost to recovery: for each attempt that follows a preempted or lost one, from the
    previous attempt's end (a lost one's lease expiry: the service could not know sooner) to
    the new attempt's claim, or to `now` while it still waits for a worker."""
    ordered = sorted(attempts, key=lambda a: a.number)
    total = 0.0
    for previous, attempt in pairwise(ordered):
        if previous.status not in PREEMPTION_STATUSES:
            continue
        ended = previous.lease_expires_at if previous.status == "lost" else previous.finished_at
        if ended is None:
            continue
        if attempt.claimed_at is not None:
            resumed = attempt.claimed_at
        elif attempt.status == "queued":
            resumed = now
        else:
            continue
        total += max(0.0, (resumed - ended).total_seconds())
    return total


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


def newest_attempt(session: Session, run_id: str) -> Attempt | None:
    """The run's newest attempt as it is now, unlocked."""
    return session.scalars(
        select(Attempt)
        .where(Attempt.run_id == run_id)
        .order_by(Attempt.number.desc())
        .limit(1)
        .execution_options(populate_existing=True)
    ).first()


def lock_current_attempt(session: Session, run_id: str) -> Attempt | None:
    """The run's newest attempt, its row locked. Attempt first, then run: the worker protocol
    (report, finish, claim) locks in that order, so resume, pause and cancel do too and cannot
    deadlock with it."""
    attempt_id = session.scalar(
        select(Attempt.id).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1)
    )
    if attempt_id is None:
        return None
    return session.scalars(
        select(Attempt)
        .where(Attempt.id == attempt_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one()


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
    if run.status in (*FINISHED_RUN_STATUSES, "paused") or run.pause_requested_at is not None:
        attempt.status = "superseded"
        attempt.finished_at = now
        if run.status not in FINISHED_RUN_STATUSES:
            run.status = "paused"
        session.commit()
        raise _superseded(attempt, None)
    workflow = session.get(Workflow, run.workflow_id)
    assert workflow is not None
    resume = latest_checkpoint(session=session, run_id=run.id)
    attempt.resume_checkpoint_id = None if resume is None else resume.id
    start = resume.step if resume is not None else phase_start(run, attempt.phase_index)
    discard_reports_after(session=session, run_id=run.id, step=start)
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
        encoder_version=run.signature_components.get("encoder_version"),
    )


def phase_start(run: Run, phase_index: int) -> int:
    """The global step a phase starts after (its first step is this + 1)."""
    return int(run.plan["phases"][phase_index]["first_step"]) - 1


def discard_reports_after(*, session: Session, run_id: str, step: int) -> None:
    """Delete the run's metric points and evaluations after `step`: the attempt starting there
    reports those steps again, so a curve has each step once, from the attempt that counts,
    and no point from an abandoned future. Does not commit."""
    for model in (MetricPoint, EvalResult):
        session.execute(
            delete(model)
            .where(model.run_id == run_id, model.step > step)
            .execution_options(synchronize_session=False)
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
    a stale token, an attempt that is no longer running or a cancelled run answers `stop`
    (not an error); a pause request answers `pause` (checkpoint, then finish `paused`)."""
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
    if run.status in FINISHED_RUN_STATUSES:
        session.rollback()
        return HeartbeatAnswer(action="stop", lease_seconds=lease_seconds)
    # The running attempt's step is the truth, even when lower (it resumed from a checkpoint).
    run.step = report.step
    # The lease is renewed either way: a pausing worker needs time to write its checkpoint.
    pausing = run.pause_requested_at is not None or run.status == "paused"
    session.commit()
    return HeartbeatAnswer(action="pause" if pausing else "continue", lease_seconds=lease_seconds)


def _advance_step(session: Session, run_id: str, step: int) -> None:
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.step < step)
        .values(step=step, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )


# The longest metric name the metrics table stores (MetricPoint.name).
MAX_METRIC_NAME = 200


@dataclass(frozen=True)
class ItemError:
    """One refused item of a batch, by its index in the request."""

    index: int
    error: str


def point_error(point: ReportedPoint) -> str | None:
    """Why one metric point cannot be stored, or None. A non-finite value is refused (a NaN
    loss is the worker's to report as a failure with cause `nan`), not stored as a gap."""
    if not point.name.strip():
        return "name is empty; name the metric (e.g. 'loss')"
    if len(point.name) > MAX_METRIC_NAME:
        return f"name is {len(point.name)} characters long; at most {MAX_METRIC_NAME} are stored"
    if not 0 <= point.step <= MAX_COUNT:
        return f"step {point.step} is out of range; steps count from 0 to {MAX_COUNT}"
    if not math.isfinite(point.value):
        return (
            f"value {point.value} at step {point.step} is not finite; only finite values are stored"
        )
    return None


def record_metrics(
    *, session: Session, attempt_id: str, batch: MetricBatch, lease_seconds: float
) -> tuple[int, list[ItemError]]:
    """Upsert points by (run, name, step): a resumed attempt's re-report wins. A point that
    cannot be stored is answered as an error with its index; the rest are stored. Returns
    (stored, errors)."""
    attempt = _fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=batch.fencing_token,
        lease_seconds=lease_seconds,
    )
    errors: list[ItemError] = []
    # One statement may not touch a row twice (Postgres refuses); the batch's last value wins.
    latest: dict[tuple[str, int], float] = {}
    for index, point in enumerate(batch.points):
        error = point_error(point)
        if error is None:
            latest[(point.name, point.step)] = point.value
        else:
            errors.append(ItemError(index=index, error=error))
    if latest:
        stmt = insert_for(session, MetricPoint).values(
            [
                {
                    "run_id": attempt.run_id,
                    "name": name,
                    "step": step,
                    "value": value,
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
    return len(batch.points) - len(errors), errors


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
    """End an attempt and move the run on (see `settle_attempt`). Returns the new attempt, if
    any, whose outbox row the caller dispatches after this commit."""
    now = utcnow()
    attempt = _fence(
        session=session,
        attempt_id=attempt_id,
        fencing_token=report.fencing_token,
        lease_seconds=lease_seconds,
        status=report.status,
        finished_at=now,
        cause=(report.cause or RETRIED_CAUSE) if report.status == "failed" else None,
        message=report.message,
    )
    run = session.get(Run, attempt.run_id, with_for_update=True)
    assert run is not None
    run.step = report.step
    next_attempt = settle_attempt(session=session, run=run, attempt=attempt, now=now)
    session.commit()
    return next_attempt


def settle_attempt(
    *, session: Session, run: Run, attempt: Attempt, now: datetime
) -> Attempt | None:
    """Move the run on after `attempt` ended (its worker finished it, or it was lost): the next
    phase, success, a pause, a failure with the attempt's cause, or a new attempt for the same
    phase from the latest checkpoint while the budget for how it ended lasts (preempted or
    lost: max_preemptions; failed with cause `infrastructure`: max_restarts). Both rows must be
    locked by the caller. Does not commit; returns the new attempt, if any."""
    if run.status in FINISHED_RUN_STATUSES:
        # Cancelled while the worker ran: nothing follows.
        return None
    phases = run.plan["phases"]
    phase = f"phase {phases[attempt.phase_index]['name']!r}"
    where = f"attempt {attempt.number} in {phase} at step {run.step}"

    if attempt.status == "succeeded":
        if attempt.phase_index + 1 == len(phases):
            run.status, run.finished_at, run.pause_requested_at = "succeeded", now, None
            return None
        run.phase_index = attempt.phase_index + 1
        if run.pause_requested_at is not None:
            run.status = "paused"
            run.message = f"paused after {phase} ended; resume continues with the next phase"
            return None
        return add_attempt(session=session, run=run, phase_index=run.phase_index)

    if attempt.status == "failed" and attempt.cause != RETRIED_CAUSE:
        run.status, run.finished_at, run.cause = "failed", now, attempt.cause
        run.message = f"{where} failed: {attempt.message or 'the worker gave no reason'}"
        return None

    if "paused" in (attempt.status, run.status) or run.pause_requested_at is not None:
        run.status = "paused"
        run.message = (
            f"paused: {where} ended {attempt.status}; resume continues from the latest checkpoint"
        )
        return None

    use = budget_use(session.scalars(select(Attempt).where(Attempt.run_id == run.id)))
    if attempt.status in PREEMPTION_STATUSES:
        used, budget, name = use.preemptions, run.max_preemptions, "max_preemptions"
        what = "was preempted" if attempt.status == "preempted" else "lost its worker"
    else:
        used, budget, name = use.restarts, run.max_restarts, "max_restarts"
        what = f"failed ({attempt.message or 'cause infrastructure'})"
    if used <= budget:
        run.status = "recovering"
        run.message = (
            f"{where} {what}; restarting from the latest checkpoint ({used} of {budget} "
            f"{name} used)"
        )
        return add_attempt(session=session, run=run, phase_index=attempt.phase_index)
    run.status, run.finished_at, run.cause = "failed", now, "restarts_exhausted"
    run.message = (
        f"{where} {what}, and the run has used all {budget} of its {name}; resume it, or "
        f"submit it again with a larger {name}"
    )
    return None
