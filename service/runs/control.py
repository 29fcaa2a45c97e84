"""Pausing and cancelling a run. Both reach a running worker through its heartbeat answer
(`pause`: checkpoint, then finish `paused`; `stop`: stop at once and write nothing more), so a
worker learns of them within one heartbeat interval. An attempt no worker has claimed yet is
superseded at once, under its row lock: a claim racing with it either comes first (and the
worker is told by its heartbeat) or finds it superseded. The attempt is the run's newest once
both are locked, even when a phase's finish added the next one meanwhile (`_lock`).
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.orm import Session

from service.db import database_now
from service.errors import ApiError
from service.lifecycle import (
    FINISHED_RUN,
    AttemptStatus,
    RunStatus,
    attempt_sources,
    lock_current_attempt,
    move_run_racing,
    newest_attempt,
)
from service.models import Attempt, Run, utcnow
from service.runs.run import get_run
from service.workers.lease import expire_attempt, lease_expired


def _lock(session: Session, run_id: str) -> tuple[Run, Attempt | None]:
    """The run and its newest attempt, both locked (the attempt first: the protocol's order).
    A phase's finish that held the attempt while this waited for it has added the next phase's
    attempt meanwhile: then the locks are let go and taken again, on that one (as resume checks
    after locking). Each turn means another attempt was added; with the run locked none can be,
    so the newest attempt read then is the one that stays."""
    get_run(session=session, run_id=run_id)
    while True:
        current = lock_current_attempt(session, run_id)
        run = session.get(Run, run_id, with_for_update=True, populate_existing=True)
        assert run is not None
        # Read, not locked: locking an attempt after its run would deadlock with a claim.
        newest = newest_attempt(session, run_id)
        if newest is None or (current is not None and newest.id == current.id):
            return run, current
        session.rollback()


def _run_finished(run: Run, action: str) -> ApiError:
    return ApiError(
        409,
        "run_finished",
        f"run {run.id} is {run.status} (finished {run.finished_at:%Y-%m-%d %H:%M:%S} UTC); it "
        f"cannot be {action}; nothing of it runs any more (GET /runs/{run.id})",
        {"run_id": run.id, "status": run.status},
    )


def _supersede(session: Session, attempt: Attempt, why: str) -> None:
    """Conditional: an attempt that finished meanwhile keeps its own ending."""
    session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt.id,
            Attempt.status.in_(attempt_sources(AttemptStatus.SUPERSEDED)),
        )
        .values(status=AttemptStatus.SUPERSEDED.value, finished_at=utcnow(), message=why)
    )


def pause_run(*, session: Session, run_id: str, judge_leases: bool = True) -> Run:
    """Pause a run: a queued attempt is superseded and the run is `paused` at once; a running
    one is asked to pause (`pause_requested_at`) and the run becomes `paused` when its worker
    finishes `paused` (or, when its lease already lapsed, at once). Without `judge_leases`
    (the service could not hear its workers lately: service.workers.reaper.Reaper.hearing) a lapsed
    lease is not taken for a dead worker: the pause is requested, and the reaper settles it.
    Repeating it changes nothing. 409 `run_finished` for a finished run. Commits."""
    run, current = _lock(session, run_id)
    if run.status in FINISHED_RUN:
        session.rollback()
        raise _run_finished(run, "paused")
    if run.status == RunStatus.PAUSED or run.pause_requested_at is not None:
        session.rollback()
        return run
    now = database_now(session)
    if judge_leases and current is not None and lease_expired(current, now):
        # Its worker is gone: nothing will answer a pause request.
        expire_attempt(session=session, attempt=current, now=now)
    if current is not None and current.status == AttemptStatus.RUNNING:
        run.pause_requested_at = now
        run.message = (
            f"pause requested: attempt {current.number} on {current.worker_hostname} (pid "
            f"{current.worker_pid}) checkpoints and stops at its next heartbeat"
        )
    else:
        if current is not None and current.status == AttemptStatus.QUEUED:
            _supersede(
                session, current, "superseded: the run was paused before a worker claimed it"
            )
        if not move_run_racing(
            session,
            run,
            RunStatus.PAUSED,
            message="paused; resume continues from the latest checkpoint",
        ):
            session.rollback()
            raise _run_finished(get_run(session=session, run_id=run_id), "paused")
    session.commit()
    session.refresh(run)
    return run


def cancel_run(*, session: Session, run_id: str) -> Run:
    """Cancel a run at once: it becomes `cancelled` and its queued or running attempt
    `superseded` (its worker's next heartbeat answers `stop`; its reports are refused).
    Repeating it changes nothing. 409 `run_finished` for a succeeded or failed run. Commits.
    A cancelled run stays resumable (service.runs.resume), from its latest checkpoint."""
    run, current = _lock(session, run_id)
    if run.status == RunStatus.CANCELLED:
        session.rollback()
        return run
    if run.status in FINISHED_RUN:
        session.rollback()
        raise _run_finished(run, "cancelled")
    if current is not None and current.status in (AttemptStatus.QUEUED, AttemptStatus.RUNNING):
        _supersede(session, current, "superseded: the run was cancelled")
    if not move_run_racing(session, run, RunStatus.CANCELLED, message="cancelled by request"):
        session.rollback()
        raise _run_finished(get_run(session=session, run_id=run_id), "cancelled")
    session.commit()
    session.refresh(run)
    return run
