"""Leases: who may work on an attempt, and until when.

A claim is one conditional UPDATE on a queued attempt: the winner gets a random per-claim
secret (`fencing_token`) and a lease. Every later call of that attempt presents the secret and
comes from the claimant's worker token; `fence` checks both and renews the lease in one
conditional UPDATE, so a superseded worker (stale secret) gets 409 `superseded` and another
worker token 403 `forbidden`, and neither writes anything. A claimant that retries a claim
whose answer it never saw (same nonce, same token) gets the same claim back.

A lease is lost two ways: it expires (no call of the attempt for `lease_seconds`: the worker died or
is cut off), or the worker's progress stalls (heartbeats keep coming from its keeper thread but the
counter they carry has not moved for `stall_seconds`: the worker hangs). The reaper marks such
attempts `lost` (cause `infrastructure` or `stalled`); see service/workers/reaper.py for the grace
it gives leases after the service could not hear them.

Both clocks are written and judged by the database's clock (`service.db.database_now`), never
by a replica's own: replicas whose clocks disagree by a lease would otherwise write leases that
the others find already run out, or judge live leases run out.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, or_, select, update
from sqlalchemy.orm import Session

from contracts.paths import RUNS_FOLDER
from contracts.reports import (
    CheckpointRef,
    Claim,
    ClaimRequest,
    Heartbeat,
    HeartbeatAnswer,
)
from contracts.signature import Digests
from runtime.store import join
from service.checkpoints.registry import USABLE
from service.db import database_now, rowcount
from service.errors import ApiError, not_found
from service.lifecycle import (
    AttemptStatus,
    RunStatus,
    attempt_sources,
    end_attempt,
    is_current,
    is_finished,
    move_run,
    phase_start,
    set_run_step,
)
from service.models import (
    ApiToken,
    Attempt,
    Checkpoint,
    EvalResult,
    MetricPoint,
    Run,
    Workflow,
)

_STOP_HINT = "stop now and write nothing more; the run is owned by a newer attempt or ended"

# The causes a lost attempt is given: its lease expired, or its progress stalled.
LOST_CAUSE = "infrastructure"
STALLED_CAUSE = "stalled"


def new_fencing_token() -> str:
    return secrets.token_urlsafe(24)


def lease_end(now: datetime, lease_seconds: float) -> datetime:
    return now + timedelta(seconds=lease_seconds)


def lease_expired(attempt: Attempt, now: datetime) -> bool:
    """A running attempt whose worker has not renewed its lease in time (killed, cut off)."""
    return (
        attempt.status == AttemptStatus.RUNNING
        and attempt.lease_expires_at is not None
        and attempt.lease_expires_at <= now
    )


def is_active(attempt: Attempt, now: datetime) -> bool:
    """Waiting for a worker, or owned by one whose lease still holds."""
    return attempt.status == AttemptStatus.QUEUED or (
        attempt.status == AttemptStatus.RUNNING and not lease_expired(attempt, now)
    )


def _lost_message(attempt: Attempt, cause: str, stall_seconds: float | None) -> str:
    worker = f"its worker ({attempt.worker_hostname}, pid {attempt.worker_pid})"
    if cause == STALLED_CAUSE:
        since = attempt.progress_at
        when = f" since {since:%Y-%m-%d %H:%M:%S} UTC" if since is not None else ""
        limit = f" (TRAINCTL_STALL_SECONDS={stall_seconds:g})" if stall_seconds else ""
        return (
            f"lost: {worker} kept its lease but reported no progress{when}{limit}; it hangs "
            "(a stuck step, a hung device or file system)"
        )
    expired_at = attempt.lease_expires_at
    if expired_at is None:
        return "lost: it held no lease"
    return (
        f"lost: {worker} sent no report before its lease expired at "
        f"{expired_at:%Y-%m-%d %H:%M:%S} UTC"
    )


def expire_attempt(
    *,
    session: Session,
    attempt: Attempt,
    now: datetime,
    stall_seconds: float | None = None,
) -> bool:
    """Mark a running attempt `lost`, in one conditional UPDATE: with cause `infrastructure`
    when its lease expired, `stalled` when (given `stall_seconds`) its progress has not moved
    for that long. A report that renewed the lease or moved the progress meanwhile (or a
    finish) wins, and this answers False. The worker, if it still lives, is then refused as
    superseded. Does not commit."""
    conditions: list[Any] = [
        Attempt.id == attempt.id,
        Attempt.status.in_(attempt_sources(AttemptStatus.LOST)),
        Attempt.fencing_token == attempt.fencing_token,
    ]
    stalled = (
        stall_seconds is not None
        and not lease_expired(attempt, now)
        and attempt.progress_at is not None
        and attempt.progress_at <= now - timedelta(seconds=stall_seconds)
    )
    if stalled:
        assert stall_seconds is not None
        conditions.append(Attempt.progress_at <= now - timedelta(seconds=stall_seconds))
        cause = STALLED_CAUSE
    else:
        conditions.append(Attempt.lease_expires_at <= now)
        cause = LOST_CAUSE
    result = session.execute(
        update(Attempt)
        .where(*conditions)
        .values(
            status=AttemptStatus.LOST.value,
            finished_at=now,
            cause=cause,
            message=_lost_message(attempt, cause, stall_seconds),
        )
        .execution_options(synchronize_session=False)
    )
    won = rowcount(result) == 1
    session.refresh(attempt)
    return won


def get_attempt(session: Session, attempt_id: str) -> Attempt:
    attempt = session.get(Attempt, attempt_id, populate_existing=True)
    if attempt is None:
        raise not_found("attempt", attempt_id, "drop this message: no such attempt exists")
    return attempt


def superseded(attempt: Attempt, *, claiming: bool = False) -> ApiError:
    why = (
        "it is no longer its run's current attempt"
        if claiming
        else "the fencing token you sent is not its claim's"
    )
    return ApiError(
        409,
        "superseded",
        f"attempt {attempt.id} (run {attempt.run_id}, number {attempt.number}) is "
        f"{attempt.status}, and {why}; {_STOP_HINT}",
        {"attempt_id": attempt.id, "status": attempt.status},
    )


def _foreign(attempt: Attempt, token: ApiToken) -> ApiError:
    return ApiError(
        403,
        "forbidden",
        f"attempt {attempt.id} was claimed with another worker token; token {token.name!r} "
        "may not write to it",
        {"attempt_id": attempt.id},
    )


def fence(
    *,
    session: Session,
    attempt_id: str,
    fencing_token: str,
    token: ApiToken,
    lease_seconds: float,
    **values: Any,
) -> Attempt:
    """Check that the attempt is running under `fencing_token` and was claimed with `token`,
    renew its lease and apply `values`, in one conditional UPDATE. On Postgres the row stays
    locked until commit, so a report and a concurrent finish (or reaper) serialise. 403
    `forbidden` for another worker token, 409 `superseded` for a stale secret or an attempt
    that no longer runs."""
    now = database_now(session)  # one round trip more per report on Postgres
    result = session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt_id,
            Attempt.status == AttemptStatus.RUNNING.value,
            Attempt.fencing_token == fencing_token,
            Attempt.claim_token_id == token.id,
        )
        .values(heartbeat_at=now, lease_expires_at=lease_end(now, lease_seconds), **values)
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        attempt = get_attempt(session, attempt_id)
        if attempt.claim_token_id is not None and attempt.claim_token_id != token.id:
            raise _foreign(attempt, token)
        raise superseded(attempt)
    return get_attempt(session, attempt_id)


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


def claim_attempt(
    *,
    session: Session,
    attempt_id: str,
    request: ClaimRequest,
    token: ApiToken,
    lease_seconds: float,
    artifact_root: str,
) -> Claim:
    """Exactly one claimant of a queued attempt wins; the others get 409 `already_claimed`
    (or `superseded` when the attempt is no longer the run's current one). The winner's retry
    (same nonce, same token) gets the same claim back."""
    now = database_now(session)
    result = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.status == AttemptStatus.QUEUED.value)
        .values(
            status=AttemptStatus.RUNNING.value,
            fencing_token=new_fencing_token(),
            claim_nonce=request.nonce,
            claim_token_id=token.id,
            worker_hostname=request.hostname,
            worker_pid=request.pid,
            claimed_at=now,
            heartbeat_at=now,
            lease_expires_at=lease_end(now, lease_seconds),
            progress=0,
            progress_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        attempt = get_attempt(session, attempt_id)
        if (
            attempt.status == AttemptStatus.RUNNING
            and attempt.claim_nonce == request.nonce
            and attempt.claim_token_id == token.id
        ):
            # The first try won and its answer was lost: the same claim again.
            return _claim_answer(session, attempt, lease_seconds, artifact_root)
        if not is_current(session, attempt):
            raise superseded(attempt, claiming=True)
        raise ApiError(
            409,
            "already_claimed",
            f"attempt {attempt.id} was already claimed by {attempt.worker_hostname} "
            f"(pid {attempt.worker_pid}) at {attempt.claimed_at} and is {attempt.status}; drop "
            "this message: messages may be delivered twice, work happens once",
            {"attempt_id": attempt.id, "status": attempt.status},
        )

    attempt = get_attempt(session, attempt_id)
    run = session.get(Run, attempt.run_id, with_for_update=True)
    assert run is not None
    if is_finished(run) or run.status == RunStatus.PAUSED or run.pause_requested_at is not None:
        state = run.status if is_finished(run) else "paused"
        end_attempt(
            attempt,
            AttemptStatus.SUPERSEDED,
            now=now,
            message=f"superseded: the run was {state} before a worker claimed it",
        )
        if not is_finished(run):
            move_run(run, RunStatus.PAUSED, now=now)
        session.commit()
        raise superseded(attempt, claiming=True)
    resume = starting_checkpoint(session=session, run=run, phase_index=attempt.phase_index)
    attempt.resume_checkpoint_id = None if resume is None else resume.id
    start = resume.step if resume is not None else phase_start(run, attempt.phase_index)
    discard_reports_after(session=session, run_id=run.id, step=start)
    move_run(run, RunStatus.RUNNING, now=now)
    run.phase_index = attempt.phase_index
    set_run_step(run, start)
    session.commit()
    return _claim_answer(session, attempt, lease_seconds, artifact_root)


def starting_checkpoint(*, session: Session, run: Run, phase_index: int) -> Checkpoint | None:
    """The newest usable checkpoint phase `phase_index` can start from: one inside the phase
    (a resume), or the previous phase's final one. None when there is none: phase 0 starts
    from its initial weights; a later phase cannot start, and its worker says so. Never the
    run's newest checkpoint blindly: with a phase's final checkpoint quarantined, that would be
    a checkpoint in the middle of the previous phase."""
    start = phase_start(run, phase_index)
    inside = and_(Checkpoint.phase_index == phase_index, Checkpoint.step > start)
    previous_final = and_(Checkpoint.phase_index == phase_index - 1, Checkpoint.step == start)
    return session.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.run_id == run.id,
            Checkpoint.status == USABLE,
            or_(inside, previous_final),
        )
        .order_by(Checkpoint.step.desc())
        .limit(1)
    ).one_or_none()


def _claim_answer(
    session: Session, attempt: Attempt, lease_seconds: float, artifact_root: str
) -> Claim:
    run = session.get(Run, attempt.run_id)
    assert run is not None and attempt.fencing_token is not None
    workflow = session.get(Workflow, run.workflow_id)
    assert workflow is not None
    resume = (
        None
        if attempt.resume_checkpoint_id is None
        else session.get(Checkpoint, attempt.resume_checkpoint_id)
    )
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
        resume_from=None if resume is None else checkpoint_ref(resume),
        artifact_dir=join(artifact_root, RUNS_FOLDER, run.id),
        encoder_version=run.signature_components.get("encoder_version"),
        devices=attempt.devices,
    )


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


def checkpoint_ref(checkpoint: Checkpoint) -> CheckpointRef:
    return CheckpointRef(
        path=checkpoint.path,
        step=checkpoint.step,
        phase_index=checkpoint.phase_index,
        phase_step=checkpoint.phase_step,
    )


def heartbeat(
    *,
    session: Session,
    attempt_id: str,
    report: Heartbeat,
    token: ApiToken,
    lease_seconds: float,
) -> HeartbeatAnswer:
    """Renew the lease and record progress. A heartbeat is how a worker learns it must stop:
    a stale secret, an attempt that is no longer running or a cancelled run answers `stop`
    (not an error); a pause request answers `pause` (checkpoint, then finish `paused`).
    `progress_at` moves only when the reported progress does: a keeper thread that heartbeats
    for a hung loop keeps the lease but not the attempt (see expire_attempt)."""
    try:
        attempt = fence(
            session=session,
            attempt_id=attempt_id,
            fencing_token=report.fencing_token,
            token=token,
            lease_seconds=lease_seconds,
        )
    except ApiError as err:
        if err.code == "superseded":
            return HeartbeatAnswer(action="stop", lease_seconds=lease_seconds)
        raise
    run = session.get(Run, attempt.run_id)
    assert run is not None
    if is_finished(run):
        session.rollback()
        return HeartbeatAnswer(action="stop", lease_seconds=lease_seconds)
    if attempt.progress != report.progress:
        # The fence's time: the database's clock, as the stall is judged by it.
        attempt.progress, attempt.progress_at = report.progress, attempt.heartbeat_at
    # Until the first step: the data file being tokenized into its store, and how far.
    preparing = report.preparing
    attempt.preparing_file = None if preparing is None else preparing.file
    attempt.preparing_fraction = None if preparing is None else preparing.fraction
    set_run_step(run, report.step)
    # The lease is renewed either way: a pausing worker needs time to write its checkpoint.
    # A yield to a higher priority (service.workers.placement) is a pause of this attempt
    # alone: the run is queued again when it ends.
    pausing = (
        run.pause_requested_at is not None
        or run.status == RunStatus.PAUSED
        or attempt.yield_requested_at is not None
    )
    session.commit()
    return HeartbeatAnswer(action="pause" if pausing else "continue", lease_seconds=lease_seconds)
