"""The reaper: running attempts whose lease expired (their worker was killed or cut off) or whose
progress stalled (their worker hangs) are marked `lost`, and their run recovers with a new attempt
from its latest checkpoint while `max_preemptions` lasts. Jobs (inspections, evaluations) hold no
lease: one running longer than `job_timeout` is queued and sent again (the first outcome posted is
kept), until it was delivered `job_max_deliveries` times; then it fails
(service.workers.job.fail_exhausted_jobs). The same pass sends a queued attempt's message again when
no free worker claimed it within `redispatch_seconds` (the broker lost it:
service.workers.dispatch.redispatch_unclaimed).

The reaper never judges a lease by time during which the service could not hear it. Every
pass that reaches the database records when (`ReaperState.heard_at`, by the database's clock,
as leases are); the service is taken to hear until one interval after a pass, when the next
is due. When this process starts (the service was down, or restarted for a deployment), when
the database answers again after a pass that could not reach it, and after this process was
frozen, the pass first grants grace: every running lease's end, and every stall clock, moves
on by the time no pass of any replica heard since then, never past one lease from now (as
Nomad resets its nodes' heartbeat timers when a new leader takes over, but only by the time
lost). A worker that lives renews its lease within what it had left; one that died is reaped
once it was heard for a lease in all. A replica that crash-loops, or restarts while others
hear, thus gives back only the time nobody heard, not a lease per start, which kept dead
workers' leases alive for as long as the loop lasted. With no pass on record, a first pass
grants one lease from now.

Safe with several service replicas reaping at once: each attempt is marked by the conditional
UPDATE in `expire_attempt`, and only the winner settles the run. A reaper that loses (another
replica won, or the worker's report renewed the lease in time) does nothing.

An attempt across many workers is lost as soon as any member's lease lapses (a member k > 0
whose heartbeats stopped, or a member that never claimed within a lease of its placement:
service.workers.lease.expire_member, which names it); member 0's is the attempt's own. Grace
moves the members' clocks as it moves the attempt's lease.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from contracts.dispatch import DEFAULT_QUEUE
from service.db import database_now, rowcount
from service.errors import is_unavailable
from service.lifecycle import AttemptStatus, settle_attempt
from service.models import Attempt, AttemptMember, Job, OutboxMessage, ReaperState, Run
from service.workers.dispatch import redispatch_unclaimed
from service.workers.job import fail_exhausted_jobs
from service.workers.lease import expire_attempt, expire_member, stale_member_attempts
from service.workers.periodic import Periodic

log = logging.getLogger(__name__)

_BATCH = 100


def grace_end(
    deadline: datetime,
    *,
    heard_at: datetime | None,
    now: datetime,
    lease: timedelta,
    interval: timedelta,
) -> datetime:
    """Where a deadline (a lease's end, or when a stall would be judged) moves to after the
    service could not hear: on by the time from one `interval` after the last pass that heard
    (`heard_at`) until `now`, never past one lease from now, never back. One that ran out while
    the service heard stays run out; with no pass on record, one lease from now."""
    ceiling = now + lease
    if deadline >= ceiling:
        return deadline
    if heard_at is None:
        return ceiling
    deaf_from = heard_at + interval
    if deadline <= deaf_from or now <= deaf_from:
        return deadline
    return min(deadline + (now - deaf_from), ceiling)


def hear(session: Session, now: datetime) -> datetime | None:
    """Record that a pass reached the database at `now`; returns the previous record. Locks the
    row (Postgres) until commit: replicas granting grace at once take turns, and the second
    finds the first's pass."""
    state = session.get(ReaperState, 1, with_for_update=True)
    if state is None:  # the row migration 0014 inserts, deleted by hand
        state = ReaperState(id=1)
        session.add(state)
    heard_at = state.heard_at
    if heard_at is None or heard_at < now:
        state.heard_at = now
    return heard_at


def record_hearing(*, session_factory: sessionmaker[Session], now: datetime) -> None:
    with session_factory() as session:
        hear(session, now)
        session.commit()


def grant_grace(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    lease_seconds: float,
    stall_seconds: float | None,
    interval: float,
) -> tuple[int, datetime | None]:
    """Move every running attempt's lease end and stall clock by `grace_end` (see the module
    docstring), in one transaction that also records this pass. The running rows are locked
    meanwhile, so a report cannot renew a lease between its read and its move. Returns how
    many leases moved, and when a pass last heard before this one (None: never)."""
    lease, pace = timedelta(seconds=lease_seconds), timedelta(seconds=interval)
    stall = None if stall_seconds is None else timedelta(seconds=stall_seconds)
    with session_factory() as session:
        heard_at = hear(session, now)

        def end(deadline: datetime) -> datetime:
            return grace_end(deadline, heard_at=heard_at, now=now, lease=lease, interval=pace)

        running = session.execute(
            select(Attempt.id, Attempt.lease_expires_at, Attempt.progress_at)
            .where(Attempt.status == AttemptStatus.RUNNING.value)
            .order_by(Attempt.id)
            .with_for_update()
        ).all()
        moves, extended = [], 0
        for attempt_id, lease_ends_at, progress_at in running:
            move = _moved(attempt_id, lease_ends_at, progress_at, end, stall)
            if move is not None:
                moves.append(move)
                extended += move["lease_expires_at"] != lease_ends_at
        if moves:
            session.execute(update(Attempt), moves)  # by primary key: one executemany
        member_moves = _member_moves(session, [row[0] for row in running], end, lease)
        if member_moves:
            session.execute(update(AttemptMember), member_moves)
        session.commit()
    return extended, heard_at


def _member_moves(
    session: Session,
    running: list[str],
    end: Callable[[datetime], datetime],
    lease: timedelta,
) -> list[dict[str, Any]]:
    """The members' lease clocks of running attempts across many workers, moved as a lease
    is: a member's lease ends a lease after its last heartbeat (claimed) or its placement (not
    claimed yet)."""
    if not running:
        return []
    moves = []
    for row in session.scalars(
        select(AttemptMember)
        .join(Attempt, Attempt.id == AttemptMember.attempt_id)
        .where(AttemptMember.attempt_id.in_(running), Attempt.nodes > 1)
        .with_for_update(of=AttemptMember)
    ):
        move: dict[str, Any] = {}
        if row.claimed_at is None:
            placed = end(row.placed_at + lease) - lease
            if placed != row.placed_at:
                move["placed_at"] = placed
        elif row.heartbeat_at is not None:
            beat = end(row.heartbeat_at + lease) - lease
            if beat != row.heartbeat_at:
                move["heartbeat_at"] = beat
        if move:
            moves.append({"attempt_id": row.attempt_id, "member": row.member, **move})
    return moves


def _moved(
    attempt_id: str,
    lease_ends_at: datetime | None,
    progress_at: datetime | None,
    end: Callable[[datetime], datetime],
    stall: timedelta | None,
) -> dict[str, Any] | None:
    """The new lease end and stall clock of one attempt, or None when neither moves."""
    new_end = None if lease_ends_at is None else end(lease_ends_at)
    new_progress = progress_at
    if stall is not None and progress_at is not None:
        # A stall is judged at progress_at + stall: that is the deadline to move.
        new_progress = end(progress_at + stall) - stall
    if (new_end, new_progress) == (lease_ends_at, progress_at):
        return None
    return {"id": attempt_id, "lease_expires_at": new_end, "progress_at": new_progress}


def reap_expired(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    stall_seconds: float | None = None,
    limit: int = _BATCH,
    lease_seconds: float | None = None,
) -> list[str]:
    """Mark running attempts whose lease expired before `now` (or, given `stall_seconds`,
    whose progress has not moved for that long; given `lease_seconds`, across many workers,
    one of whose members' leases lapsed) lost and settle their runs, one transaction per
    attempt. Returns the ids of the attempts this call marked; their new attempts' outbox
    rows are committed, for the caller to dispatch."""
    due = Attempt.lease_expires_at <= now
    if stall_seconds is not None:
        due = or_(due, Attempt.progress_at <= now - timedelta(seconds=stall_seconds))
    with session_factory() as session:
        candidates = list(
            session.scalars(
                select(Attempt.id)
                .where(Attempt.status == AttemptStatus.RUNNING.value, due)
                .order_by(Attempt.lease_expires_at)
                .limit(limit)
            )
        )
        if lease_seconds is not None:
            members = session.scalars(
                stale_member_attempts(session, now, lease_seconds).limit(limit)
            )
            candidates += [a for a in members if a not in candidates]
    reaped = []
    for attempt_id in candidates:
        with session_factory() as session:
            try:
                if _reap_one(
                    session,
                    attempt_id,
                    now=now,
                    stall_seconds=stall_seconds,
                    lease_seconds=lease_seconds,
                ):
                    reaped.append(attempt_id)
            except SQLAlchemyError:
                raise  # the database: the whole pass failed (Reaper.reap decides on grace)
            except Exception:
                # One row that cannot be settled (an inconsistent old run, a bug) must not stop
                # every attempt queued behind it from being reaped, pass after pass.
                session.rollback()
                log.exception("attempt %s could not be reaped; the others go on", attempt_id)
    return reaped


def _reap_one(
    session: Session,
    attempt_id: str,
    *,
    now: datetime,
    stall_seconds: float | None,
    lease_seconds: float | None = None,
) -> bool:
    attempt = session.get(Attempt, attempt_id)
    if attempt is None:
        return False
    # A lost member first: its message names it (the attempt's own lease says less).
    lost = (
        lease_seconds is not None
        and attempt.nodes > 1
        and expire_member(session=session, attempt=attempt, now=now, lease_seconds=lease_seconds)
    )
    if not lost and not expire_attempt(
        session=session, attempt=attempt, now=now, stall_seconds=stall_seconds
    ):
        session.rollback()
        return False
    # The attempt row is locked by the UPDATE; then the run (the protocol's order).
    run = session.get(Run, attempt.run_id, with_for_update=True, populate_existing=True)
    assert run is not None
    new = settle_attempt(session=session, run=run, attempt=attempt, now=now)
    session.commit()
    log.warning(
        "attempt %s (run %s, number %d) is lost (%s); %s",
        attempt.id,
        run.id,
        attempt.number,
        attempt.cause,
        f"new attempt {new.number} queued" if new is not None else f"run is {run.status}",
    )
    return True


def requeue_stale_jobs(
    *, session_factory: sessionmaker[Session], now: datetime, timeout: float
) -> list[str]:
    """Queue again, with a new outbox row, every job running since before `now - timeout`.
    A conditional UPDATE per job: a replica that lost the race, or an outcome that arrived
    meanwhile, leaves it alone. Returns the ids queued again."""
    cutoff = now - timedelta(seconds=timeout)
    with session_factory() as session:
        stale = list(
            session.scalars(
                select(Job.id)
                .where(Job.status == "running", Job.started_at <= cutoff)
                .limit(_BATCH)
            )
        )
    requeued = []
    for job_id in stale:
        with session_factory() as session:
            won = session.execute(
                update(Job)
                .where(Job.id == job_id, Job.status == "running", Job.started_at <= cutoff)
                .values(status="queued")
                .execution_options(synchronize_session=False)
            )
            if rowcount(won) != 1:
                session.rollback()
                continue
            session.add(OutboxMessage(job_id=job_id))
            session.commit()
        log.warning("job %s ran for more than %.0f s; sent to a worker again", job_id, timeout)
        requeued.append(job_id)
    return requeued


class Reaper(Periodic):
    """Runs `reap_expired` every `interval` seconds in a thread, then `dispatch` when it
    queued new attempts. Its first pass, the first that works after one that could not reach
    the database, and the first after this process was frozen grant grace first
    (`grant_grace`)."""

    name = "reaper"

    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        dispatch: Callable[[], object],
        interval: float,
        lease_seconds: float,
        stall_seconds: float,
        job_timeout: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        job_max_deliveries: int = 3,
        redispatch_seconds: float = 300.0,
        queue: str = DEFAULT_QUEUE,
    ) -> None:
        super().__init__(interval=interval)
        self.session_factory = session_factory
        self.dispatch = dispatch
        self.lease_seconds = lease_seconds
        self.stall_seconds = stall_seconds
        self.job_timeout = job_timeout
        self.clock = clock
        self.job_max_deliveries = job_max_deliveries
        self.redispatch_seconds = redispatch_seconds
        self.queue = queue
        # Set at start and after a pass that could not reach the database: the service could
        # not hear its workers.
        self.owes_grace = True
        self.graces = 0  # how many times grace was granted (tests, logs)
        self._last_pass: float | None = None  # `clock()` at the end of the last pass

    def hearing(self) -> bool:
        """Whether leases may be judged now: grace is not owed, and the passes keep their pace
        (a process that was frozen, its host suspended or its threads starved, heard nobody
        meanwhile). Pause and resume judge leases only while this holds."""
        return not self.owes_grace and not self._deaf()

    def _deaf(self) -> bool:
        return self._last_pass is not None and self.clock() - self._last_pass > self._pace

    @property
    def _pace(self) -> float:
        # Passes are `interval` apart; one that comes much later means a stalled process.
        return 2 * self.interval + 1.0

    def reap(self, now: datetime | None = None) -> list[str]:
        """One pass at `now` (default: the database's clock, by which leases are written: a
        replica's own clock may run ahead or behind the others'), then dispatch what it
        queued."""
        if self._deaf():
            log.warning(
                "the reaper's last pass ended %.0f s ago (every %.1f s expected): this process "
                "was not running, so it heard no worker meanwhile",
                self.clock() - (self._last_pass or 0.0),
                self.interval,
            )
            self.owes_grace = True
        try:
            now = now or self._database_now()
            if self.owes_grace:
                self._grant_grace(now)
            else:
                record_hearing(session_factory=self.session_factory, now=now)
            reaped = reap_expired(
                session_factory=self.session_factory,
                now=now,
                stall_seconds=self.stall_seconds,
                lease_seconds=self.lease_seconds,
            )
            fail_exhausted_jobs(
                session_factory=self.session_factory,
                now=now,
                timeout=self.job_timeout,
                max_deliveries=self.job_max_deliveries,
            )
            requeued = requeue_stale_jobs(
                session_factory=self.session_factory, now=now, timeout=self.job_timeout
            )
            resent = redispatch_unclaimed(
                session_factory=self.session_factory,
                now=now,
                after=self.redispatch_seconds,
                lease_seconds=self.lease_seconds,
                queue=self.queue,
            )
        except SQLAlchemyError as err:
            # The database being down is reported by /readyz; one line per pass is enough.
            log.warning("reaper pass failed (%s); retrying in %.1f s", err, self.interval)
            if is_unavailable(err):
                # Reports could not be stored meanwhile either: leases went unrenewed.
                self.owes_grace = True
            return []
        self._last_pass = self.clock()
        if reaped or requeued or resent:
            self.dispatch()
        return reaped

    def _grant_grace(self, now: datetime) -> None:
        extended, heard_at = grant_grace(
            session_factory=self.session_factory,
            now=now,
            lease_seconds=self.lease_seconds,
            stall_seconds=self.stall_seconds,
            interval=self.interval,
        )
        self.owes_grace = False
        self.graces += 1
        unheard = "unknown: no pass on record" if heard_at is None else f"since {heard_at}"
        log.info(
            "granted %d running leases grace (up to %.0f s): the service could not hear their "
            "workers from one pass interval after the last pass that did (%s) until now",
            extended,
            self.lease_seconds,
            unheard,
        )

    def _database_now(self) -> datetime:
        with self.session_factory() as session:
            return database_now(session)

    def run_once(self) -> list[str]:
        return self.reap()

    def __repr__(self) -> str:
        return f"Reaper(interval={self.interval})"
