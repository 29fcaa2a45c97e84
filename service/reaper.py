"""The reaper: running attempts whose lease expired (their worker was killed or cut off) are
marked `lost`, and their run recovers with a new attempt from its latest checkpoint while
`max_preemptions` lasts.

Safe with several service replicas reaping at once: each attempt is marked by the conditional
UPDATE in `expire_attempt`, and only the winner settles the run. A reaper that loses (another
replica won, or the worker's report renewed the lease in time) does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.attempt import expire_attempt, settle_attempt
from service.models import Attempt, Run, utcnow
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
    ) -> None:
        super().__init__(interval=interval)
        self.session_factory = session_factory
        self.dispatch = dispatch

    def reap(self, now: datetime | None = None) -> list[str]:
        """One pass at `now` (default: the current time), then dispatch what it queued."""
        try:
            reaped = reap_expired(session_factory=self.session_factory, now=now or utcnow())
        except SQLAlchemyError as err:
            # The database being down is reported by /readyz; one line per pass is enough.
            log.warning("reaper pass failed (%s); retrying in %.1f s", err, self.interval)
            return []
        if reaped:
            self.dispatch()
        return reaped

    def run_once(self) -> list[str]:
        return self.reap()

    def __repr__(self) -> str:
        return f"Reaper(interval={self.interval})"
