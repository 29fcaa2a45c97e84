"""The reaper: running attempts whose lease expired (their worker was killed or cut off) or
whose progress stalled (their worker hangs) are marked `lost`, and their run recovers with a
new attempt from its latest checkpoint while `max_preemptions` lasts. Jobs (inspections,
evaluations) hold no lease: one running longer than `job_timeout` is queued and sent again
(the first outcome posted is kept).

The reaper never judges a lease by time during which the service could not hear it. When this
process starts (the service was down, or restarted for a deployment) and when the database
answers again after a failed pass, the first pass grants grace instead of reaping: every
running lease is extended to at least one lease period from now, and every stall clock to at
least one lease period before it would run out (as Nomad resets its nodes' heartbeat timers
when a new leader takes over). A worker that lives renews its lease within that period; one
that died is reaped one lease later than it would have been.

Safe with several service replicas reaping at once: each attempt is marked by the conditional
UPDATE in `expire_attempt`, and only the winner settles the run. A reaper that loses (another
replica won, or the worker's report renewed the lease in time) does nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.db import database_now, rowcount
from service.errors import is_unavailable
from service.lease import expire_attempt, lease_end
from service.lifecycle import AttemptStatus, settle_attempt
from service.models import Attempt, Job, OutboxMessage, Run
from service.periodic import Periodic

log = logging.getLogger(__name__)

_BATCH = 100


def grant_grace(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    lease_seconds: float,
    stall_seconds: float | None,
) -> int:
    """Give every running attempt one lease period from `now` before its lease or its stall
    clock may run out (see the module docstring). Two conditional UPDATEs, one transaction;
    a lease that already runs longer is left alone. Returns how many leases were extended."""
    grace_end = lease_end(now, lease_seconds)
    running = Attempt.status == AttemptStatus.RUNNING.value
    with session_factory() as session:
        extended = rowcount(
            session.execute(
                update(Attempt)
                .where(running, Attempt.lease_expires_at < grace_end)
                .values(lease_expires_at=grace_end)
                .execution_options(synchronize_session=False)
            )
        )
        if stall_seconds is not None:
            # A stall is judged when progress_at <= now - stall_seconds: not within the grace.
            stall_floor = grace_end - timedelta(seconds=stall_seconds)
            session.execute(
                update(Attempt)
                .where(running, Attempt.progress_at < stall_floor)
                .values(progress_at=stall_floor)
                .execution_options(synchronize_session=False)
            )
        session.commit()
    return extended


def reap_expired(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    stall_seconds: float | None = None,
    limit: int = _BATCH,
) -> list[str]:
    """Mark running attempts whose lease expired before `now` (or, given `stall_seconds`,
    whose progress has not moved for that long) lost and settle their runs, one transaction
    per attempt. Returns the ids of the attempts this call marked; their new attempts' outbox
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
    reaped = []
    for attempt_id in candidates:
        with session_factory() as session:
            try:
                if _reap_one(session, attempt_id, now=now, stall_seconds=stall_seconds):
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
    session: Session, attempt_id: str, *, now: datetime, stall_seconds: float | None
) -> bool:
    attempt = session.get(Attempt, attempt_id)
    if attempt is None or not expire_attempt(
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
    queued new attempts. Its first pass, and the first that works after a failed one, grants
    grace instead (`grant_grace`)."""

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
    ) -> None:
        super().__init__(interval=interval)
        self.session_factory = session_factory
        self.dispatch = dispatch
        self.lease_seconds = lease_seconds
        self.stall_seconds = stall_seconds
        self.job_timeout = job_timeout
        self.clock = clock
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
                extended = grant_grace(
                    session_factory=self.session_factory,
                    now=now,
                    lease_seconds=self.lease_seconds,
                    stall_seconds=self.stall_seconds,
                )
                self.owes_grace = False
                self.graces += 1
                log.info(
                    "granted %d running leases %.0f s of grace: the service could not hear "
                    "their workers until now",
                    extended,
                    self.lease_seconds,
                )
                self._last_pass = self.clock()
                return []
            reaped = reap_expired(
                session_factory=self.session_factory, now=now, stall_seconds=self.stall_seconds
            )
            requeued = requeue_stale_jobs(
                session_factory=self.session_factory, now=now, timeout=self.job_timeout
            )
        except SQLAlchemyError as err:
            # The database being down is reported by /readyz; one line per pass is enough.
            log.warning("reaper pass failed (%s); retrying in %.1f s", err, self.interval)
            if is_unavailable(err):
                # Reports could not be stored meanwhile either: leases went unrenewed.
                self.owes_grace = True
            return []
        self._last_pass = self.clock()
        if reaped or requeued:
            self.dispatch()
        return reaped

    def _database_now(self) -> datetime:
        with self.session_factory() as session:
            return database_now(session)

    def run_once(self) -> list[str]:
        return self.reap()

    def __repr__(self) -> str:
        return f"Reaper(interval={self.interval})"
