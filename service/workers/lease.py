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

A phase across machines (`attempt.nodes` N > 1) has N members, each placed on its own worker
(`attempt_members`, service.workers.placement) and each claiming its own part (`claim_member`):
the first member's claim starts the attempt as a one-node claim does (fencing token, lease, the
run running), the others join it, and every member's answer carries the same fencing token,
its `node_rank` and the `rendezvous` (member 0's worker's address, `rendezvous_port`). Member 0
holds the attempt's lease as above (it reports, checkpoints, finishes); every other member
keeps its own (`member_heartbeat` renews its row's `heartbeat_at`), and the reaper loses the
attempt when any member's lease lapses or a member never claims within a lease of its
placement (`expire_member`).

Both clocks are written and judged by the database's clock (`service.db.database_now`), never
by a replica's own: replicas whose clocks disagree by a lease would otherwise write leases that
the others find already run out, or judge live leases run out.
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, func, or_, select, update
from sqlalchemy.orm import Session

from contracts.paths import RUNS_FOLDER
from contracts.reports import (
    CheckpointRef,
    Claim,
    ClaimRequest,
    Heartbeat,
    HeartbeatAnswer,
    Rendezvous,
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
    AttemptMember,
    Checkpoint,
    EvalResult,
    MetricPoint,
    Run,
    Worker,
    Workflow,
)

_STOP_HINT = "stop now and write nothing more; the run is owned by a newer attempt or ended"

# The causes a lost attempt is given: its lease expired, or its progress stalled.
LOST_CAUSE = "infrastructure"
STALLED_CAUSE = "stalled"


# The ports an attempt's rendezvous is served at: below Linux's ephemeral range (32768-60999),
# so no outgoing connection of the host holds one by chance.
RENDEZVOUS_PORTS = (20000, 32000)


def rendezvous_port(attempt_id: str) -> int:
    """The port the members of attempt `attempt_id` meet at, on member 0's host: derived from
    the attempt's id (every member's claim, and a retried one, gets the same without storing
    it). Two attempts whose member 0 shares a host collide with odds 1 in 12,000; the second
    then fails to serve its store and is recovered as a new attempt, with a new id and port."""
    low, high = RENDEZVOUS_PORTS
    digest = hashlib.sha256(attempt_id.encode()).digest()
    return low + int.from_bytes(digest[:4], "big") % (high - low)


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
    (same nonce, same token) gets the same claim back. A member of an attempt across many
    workers (`request.member`, or an attempt of more than one node) claims its part
    (`claim_member`)."""
    if request.member > 0:
        return claim_member(
            session=session,
            attempt_id=attempt_id,
            request=request,
            token=token,
            lease_seconds=lease_seconds,
            artifact_root=artifact_root,
        )
    now = database_now(session)
    result = session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt_id,
            Attempt.status == AttemptStatus.QUEUED.value,
            Attempt.nodes == 1,
        )
        .values(_claimed_values(request, token, now, lease_seconds))
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        attempt = get_attempt(session, attempt_id)
        if attempt.nodes > 1:
            return claim_member(
                session=session,
                attempt_id=attempt_id,
                request=request,
                token=token,
                lease_seconds=lease_seconds,
                artifact_root=artifact_root,
            )
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
    _start_run(session, attempt, now)
    return _claim_answer(session, attempt, lease_seconds, artifact_root)


def _claimed_values(
    request: ClaimRequest, token: ApiToken, now: datetime, lease_seconds: float
) -> dict[str, Any]:
    """What a queued attempt's row becomes when its (first) claimant wins it."""
    return {
        "status": AttemptStatus.RUNNING.value,
        "fencing_token": new_fencing_token(),
        "claim_nonce": request.nonce,
        "claim_token_id": token.id,
        "worker_hostname": request.hostname,
        "worker_pid": request.pid,
        "claimed_at": now,
        "heartbeat_at": now,
        "lease_expires_at": lease_end(now, lease_seconds),
        "progress": 0,
        "progress_at": now,
    }


def _start_run(session: Session, attempt: Attempt, now: datetime) -> None:
    """The run's side of an attempt's first claim: superseded (409, committed) when the run
    ended or was paused before the claim, else running from its starting checkpoint, with the
    reports after that step discarded. Commits."""
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


def _member_refusal(attempt: Attempt, member: int, code: str, why: str) -> ApiError:
    return ApiError(
        409,
        code,
        f"member {member} of attempt {attempt.id} (run {attempt.run_id}, {attempt.nodes} "
        f"node(s)): {why}; drop this message",
        {"attempt_id": attempt.id, "member": member, "nodes": attempt.nodes},
    )


def _claimant_key(session: Session, request: ClaimRequest) -> str | None:
    """The key of the worker process that claims (by hostname and pid, as its pings named
    it); None when it never pinged with a key."""
    return session.scalar(
        select(Worker.key).where(Worker.hostname == request.hostname, Worker.pid == request.pid)
    )


def claim_member(
    *,
    session: Session,
    attempt_id: str,
    request: ClaimRequest,
    token: ApiToken,
    lease_seconds: float,
    artifact_root: str,
) -> Claim:
    """Member `request.member` of an attempt across many workers claims its part. Refused
    (409) when the attempt has no such member (`not_a_member`), the member is not placed
    (`not_placed`: placement took it back) or is placed on another worker than the claimant
    (`not_placed_here`, when the claimant's pings named its key), or another claimant already
    claimed it (`already_claimed`; the same nonce and token get the same answer again). The
    first member to claim starts the attempt as a one-node claim does; the others join it.
    Member 0's claim makes the attempt's claimant its own (its token fences the attempt's
    reports and finish; its host names the attempt). The member's row is locked first, then
    the attempt, then the run."""
    attempt = get_attempt(session, attempt_id)
    k = request.member
    if k >= attempt.nodes:
        raise _member_refusal(
            attempt, k, "not_a_member", f"the attempt runs on {attempt.nodes} worker(s)"
        )
    row = session.get(AttemptMember, (attempt_id, k), with_for_update=True, populate_existing=True)
    if row is None:
        if attempt.status not in (AttemptStatus.QUEUED, AttemptStatus.RUNNING):
            raise superseded(attempt, claiming=True)
        session.rollback()
        raise _member_refusal(
            attempt, k, "not_placed", "it is placed on no worker (its placement was taken back)"
        )
    here = _claimant_key(session, request)
    if here is not None and here != row.worker_id:
        session.rollback()
        raise _member_refusal(
            attempt,
            k,
            "not_placed_here",
            f"it is placed on worker {row.worker_id}, not on {request.hostname} (pid "
            f"{request.pid}, worker {here})",
        )
    if row.claimed_at is not None:
        session.rollback()
        attempt = get_attempt(session, attempt_id)
        if (
            attempt.status == AttemptStatus.RUNNING
            and row.claim_nonce == request.nonce
            and row.claim_token_id == token.id
        ):
            # The first try won and its answer was lost: the same claim again.
            return _claim_answer(session, attempt, lease_seconds, artifact_root, member=k)
        if attempt.status != AttemptStatus.RUNNING:
            raise superseded(attempt, claiming=True)
        raise _member_refusal(
            attempt,
            k,
            "already_claimed",
            f"it was already claimed by {row.worker_hostname} (pid {row.worker_pid}) at "
            f"{row.claimed_at}; messages may be delivered twice, work happens once",
        )
    now = database_now(session)
    first = session.execute(
        update(Attempt)
        .where(Attempt.id == attempt_id, Attempt.status == AttemptStatus.QUEUED.value)
        .values(_claimed_values(request, token, now, lease_seconds))
        .execution_options(synchronize_session=False)
    )
    started = rowcount(first) == 1
    attempt = get_attempt(session, attempt_id)
    if attempt.status != AttemptStatus.RUNNING:
        session.rollback()
        raise superseded(attempt, claiming=True)
    if k == 0 and not started:
        # Another member claimed first; the attempt's reports and finish are member 0's.
        attempt.claim_nonce, attempt.claim_token_id = request.nonce, token.id
        attempt.worker_hostname, attempt.worker_pid = request.hostname, request.pid
    row.claimed_at, row.heartbeat_at = now, now
    row.claim_nonce, row.claim_token_id = request.nonce, token.id
    row.worker_hostname, row.worker_pid = request.hostname, request.pid
    if started:
        _start_run(session, attempt, now)
    else:
        session.commit()
    return _claim_answer(session, attempt, lease_seconds, artifact_root, member=k)


def rendezvous_of(session: Session, attempt: Attempt) -> Rendezvous:
    """Where the members of `attempt` meet: member 0's worker's advertised address (its
    hostname when its pings said none, or the hostname member 0 claimed with when its worker
    row is gone) and the attempt's port."""
    key = session.scalar(
        select(AttemptMember.worker_id).where(
            AttemptMember.attempt_id == attempt.id, AttemptMember.member == 0
        )
    )
    host = None
    if key is not None:
        host = session.scalar(
            select(func.coalesce(Worker.address, Worker.hostname))
            .where(Worker.key == key)
            .order_by(Worker.last_seen_at.desc())
            .limit(1)
        )
    if host is None:
        host = session.scalar(
            select(AttemptMember.worker_hostname).where(
                AttemptMember.attempt_id == attempt.id, AttemptMember.member == 0
            )
        )
    if host is None:
        raise _member_refusal(
            attempt, 0, "not_placed", "member 0's worker is unknown, so there is no rendezvous"
        )
    return Rendezvous(host=host, port=rendezvous_port(attempt.id))


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
    session: Session,
    attempt: Attempt,
    lease_seconds: float,
    artifact_root: str,
    *,
    member: int = 0,
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
        nodes=attempt.nodes,
        node_rank=member,
        rendezvous=rendezvous_of(session, attempt) if attempt.nodes > 1 else None,
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
    for a hung loop keeps the lease but not the attempt (see expire_attempt). A member k > 0
    of an attempt across many workers renews its own lease (`member_heartbeat`)."""
    if report.member > 0:
        return member_heartbeat(
            session=session,
            attempt_id=attempt_id,
            report=report,
            token=token,
            lease_seconds=lease_seconds,
        )
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
    return _order(session, run, attempt, lease_seconds)


def _order(session: Session, run: Run, attempt: Attempt, lease_seconds: float) -> HeartbeatAnswer:
    """Commit the renewed lease and answer the attempt's order: `pause` while the run is
    paused or asked to, or the attempt told to yield to a higher priority
    (service.workers.placement: a pause of this attempt alone, the run queued again when it
    ends); `continue` otherwise. The lease is renewed either way: a pausing worker needs time
    to write its checkpoint."""
    pausing = (
        run.pause_requested_at is not None
        or run.status == RunStatus.PAUSED
        or attempt.yield_requested_at is not None
    )
    session.commit()
    return HeartbeatAnswer(action="pause" if pausing else "continue", lease_seconds=lease_seconds)


def fence_member(
    *, session: Session, attempt_id: str, member: int, fencing_token: str, token: ApiToken
) -> tuple[Attempt, AttemptMember]:
    """Check that member `member` (> 0) of the attempt was claimed with `token` and that the
    attempt runs under `fencing_token`, and renew the member's lease (`heartbeat_at`), in one
    conditional UPDATE of the member's row (locked until commit). 403 `forbidden` for another
    worker token, 409 `superseded` otherwise (the attempt was lost, failed, ended, or the
    secret is stale)."""
    now = database_now(session)
    running = exists().where(
        Attempt.id == attempt_id,
        Attempt.status == AttemptStatus.RUNNING.value,
        Attempt.fencing_token == fencing_token,
    )
    result = session.execute(
        update(AttemptMember)
        .where(
            AttemptMember.attempt_id == attempt_id,
            AttemptMember.member == member,
            AttemptMember.claimed_at.is_not(None),
            AttemptMember.claim_token_id == token.id,
            running,
        )
        .values(heartbeat_at=now)
        .execution_options(synchronize_session=False)
    )
    if rowcount(result) != 1:
        session.rollback()
        attempt = get_attempt(session, attempt_id)
        row = session.get(AttemptMember, (attempt_id, member), populate_existing=True)
        if row is not None and row.claim_token_id not in (None, token.id):
            raise _foreign(attempt, token)
        raise superseded(attempt)
    row = session.get(AttemptMember, (attempt_id, member), populate_existing=True)
    assert row is not None
    return get_attempt(session, attempt_id), row


def member_heartbeat(
    *,
    session: Session,
    attempt_id: str,
    report: Heartbeat,
    token: ApiToken,
    lease_seconds: float,
) -> HeartbeatAnswer:
    """Member k > 0 renews its own lease and hears the attempt's order: `stop` when the
    attempt no longer runs under its secret (another member was lost, it failed or ended, the
    run was cancelled), `pause` while the run or the attempt is told to (member 0's ranks
    checkpoint; this member's follow rank 0's order), else `continue`. Its step and progress
    are not the attempt's (member 0 reports those) and are not stored."""
    try:
        attempt, _ = fence_member(
            session=session,
            attempt_id=attempt_id,
            member=report.member,
            fencing_token=report.fencing_token,
            token=token,
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
    return _order(session, run, attempt, lease_seconds)


def _stale_member(attempt_id: Any, cutoff: datetime) -> Any:
    """A member of the attempt whose lease lapsed at `cutoff` (now minus a lease): one that
    never claimed within a lease of its placement, or a member k > 0 whose last heartbeat (or
    claim) is older. Member 0, once claimed, holds the attempt's own lease."""
    return and_(
        AttemptMember.attempt_id == attempt_id,
        or_(
            and_(AttemptMember.claimed_at.is_(None), AttemptMember.placed_at <= cutoff),
            and_(
                AttemptMember.member > 0,
                AttemptMember.claimed_at.is_not(None),
                AttemptMember.heartbeat_at <= cutoff,
            ),
        ),
    )


def stale_member_attempts(session: Session, now: datetime, lease_seconds: float) -> Any:
    """A query of the running attempts across many workers that have a member whose lease
    lapsed (`_stale_member`)."""
    cutoff = now - timedelta(seconds=lease_seconds)
    return (
        select(Attempt.id)
        .where(
            Attempt.status == AttemptStatus.RUNNING.value,
            Attempt.nodes > 1,
            exists().where(_stale_member(Attempt.id, cutoff)),
        )
        .order_by(Attempt.id)
    )


def _member_lost_message(attempt: Attempt, row: AttemptMember, lease_seconds: float) -> str:
    who = f"member {row.member} of {attempt.nodes}"
    if row.claimed_at is None:
        return (
            f"lost: {who} (placed on worker {row.worker_id} at "
            f"{row.placed_at:%Y-%m-%d %H:%M:%S} UTC) did not claim its part within a lease "
            f"({lease_seconds:g} s): its worker died, or never got the message"
        )
    seen = row.heartbeat_at or row.claimed_at
    return (
        f"lost: {who} ({row.worker_hostname}, pid {row.worker_pid}) sent no heartbeat since "
        f"{seen:%Y-%m-%d %H:%M:%S} UTC, a lease ({lease_seconds:g} s): its worker died or is "
        "cut off; the other members are told to stop"
    )


def expire_member(
    *, session: Session, attempt: Attempt, now: datetime, lease_seconds: float
) -> bool:
    """Mark a running attempt across many workers `lost` (cause `infrastructure`) because one
    of its members' leases lapsed (`_stale_member`), naming the first such member, in one
    conditional UPDATE: a heartbeat of that member that arrived meanwhile, a finish, or
    another replica's reaper wins, and this answers False. The other members then hear
    `stop`. Does not commit."""
    cutoff = now - timedelta(seconds=lease_seconds)
    row = session.scalars(
        select(AttemptMember)
        .where(_stale_member(attempt.id, cutoff))
        .order_by(AttemptMember.member)
        .limit(1)
    ).first()
    if row is None:
        return False
    still = exists().where(_stale_member(attempt.id, cutoff), AttemptMember.member == row.member)
    result = session.execute(
        update(Attempt)
        .where(
            Attempt.id == attempt.id,
            Attempt.status.in_(attempt_sources(AttemptStatus.LOST)),
            Attempt.fencing_token == attempt.fencing_token,
            still,
        )
        .values(
            status=AttemptStatus.LOST.value,
            finished_at=now,
            cause=LOST_CAUSE,
            message=_member_lost_message(attempt, row, lease_seconds),
        )
        .execution_options(synchronize_session=False)
    )
    won = rowcount(result) == 1
    session.refresh(attempt)
    return won
