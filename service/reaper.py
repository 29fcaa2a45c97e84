"""The reaper: running attempts whose lease expired (their worker was killed or cut off) are
marked `lost`, and their run recovers with a new attempt from its latest checkpoint while
`max_preemptions` lasts. Jobs (inspections, evaluations) hold no lease: one running longer
than `job_timeout` is queued and sent again (the first outcome posted is kept).

Safe with several service replicas reaping at once: each attempt is marked by the conditional
UPDATE in `expire_attempt`, and only the winner settles the run. A reaper that loses (another
replica won, or the worker's report renewed the lease in time) does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.attempt import expire_attempt, settle_attempt
from service.db import rowcount
from service.models import Attempt, Job, OutboxMessage, Run, utcnow
from service.periodic import Periodic

log = logging.getLogger(__name__)

_BATCH = 100


def reap_expired(
    *, session_factory: sessionmaker[Session], now: datetime, limit: int = _BATCH
) -> list[str]:
    """Mark running attempts whose lease expired before `now` lost and settle their runs, one
    transaction per attempt. Returns the ids of the attempts this call marked; their new
    attempts' outbox rows are committed, for the caller to dispatch."""
    with session_factory() as session:
        candidates = list(
            session.scalars(
                select(Attempt.id)
                .where(Attempt.status == "running", Attempt.lease_expires_at <= now)
                .order_by(Attempt.lease_expires_at)
                .limit(limit)
            )
        )
    reaped = []
    for attempt_id in candidates:
        with session_factory() as session:
            attempt = session.get(Attempt, attempt_id)
            if attempt is None or not expire_attempt(session=session, attempt=attempt, now=now):
                session.rollback()
                continue
            # The attempt row is locked by the UPDATE; then the run (the protocol's order).
            run = session.get(Run, attempt.run_id, with_for_update=True, populate_existing=True)
            assert run is not None
            new = settle_attempt(session=session, run=run, attempt=attempt, now=now)
            session.commit()
            log.warning(
                "attempt %s (run %s, number %d) lost its lease; %s",
                attempt.id,
                run.id,
                attempt.number,
                f"new attempt {new.number} queued" if new is not None else f"run is {run.status}",
            )
            reaped.append(attempt.id)
    return reaped


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
    queued new attempts."""

    name = "reaper"

    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        dispatch: Callable[[], object],
        interval: float,
        job_timeout: float = 3600.0,
    ) -> None:
        super().__init__(interval=interval)
        self.session_factory = session_factory
        self.dispatch = dispatch
        self.job_timeout = job_timeout

    def reap(self, now: datetime | None = None) -> list[str]:
        """One pass at `now` (default: the current time), then dispatch what it queued."""
        now = now or utcnow()
        try:
            reaped = reap_expired(session_factory=self.session_factory, now=now)
            requeued = requeue_stale_jobs(
                session_factory=self.session_factory, now=now, timeout=self.job_timeout
            )
        except SQLAlchemyError as err:
            # The database being down is reported by /readyz; one line per pass is enough.
            log.warning("reaper pass failed (%s); retrying in %.1f s", err, self.interval)
            return []
        if reaped or requeued:
            self.dispatch()
        return reaped

    def run_once(self) -> list[str]:
        return self.reap()

    def __repr__(self) -> str:
        return f"Reaper(interval={self.interval})"
