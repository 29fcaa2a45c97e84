"""Commit, then enqueue: the outbox pump.

An attempt's or a job's Celery message is first an outbox row: a job's is written in the
transaction that creates the job, an attempt's by the placement pass that puts it on workers
(service.workers.placement: one row per member, addressed to that worker's own queue,
contracts.dispatch.worker_queue). After the commit, `dispatch_pending` sends unsent rows by task
name and marks them sent; a background thread repeats that (placement pass first) every
`outbox_interval_seconds`, so a message whose send failed (broker down, process died) goes out
later. Jobs go to the base queue, which every worker consumes. An attempt row with no queue (one
written before migration 0019) is marked sent unsent: placement sends the attempt's messages.
A row may be sent twice (a crash between the send and the mark): workers tolerate that,
because a claim has exactly one winner and a job's first result is the one kept. Each send of
a job's row counts as one of its deliveries (`Job.deliveries`, its budget:
service.workers.job.fail_exhausted_jobs).

A message the broker took can still be lost (Redis restarted without persistence, a queue
purged by hand), and its attempt would then stay queued for good: `redispatch_unclaimed`, run
by the reaper's pass, sends an attempt again when a worker that could take it has been free
for a while and nobody claimed it.
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime
from typing import Any

from celery import Celery
from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from contracts.dispatch import (
    DIGEST_INPUT_TASK,
    EVALUATE_CHECKPOINT_TASK,
    INSPECT_DATASET_TASK,
    PREPARE_DATASET_TASK,
    RUN_PHASE_TASK,
)
from runtime.broker import broker_options
from service.db import database_now
from service.models import Job, OutboxMessage
from service.workers.periodic import Periodic
from service.workers.placement import place, unplace_stale

log = logging.getLogger(__name__)

# Without a bound, kombu retries an unreachable broker for seconds before giving up; the
# outbox retries anyway, so one quick reconnect is enough.
_PUBLISH_FAILOVER = {
    "max_retries": 1,
    "interval_start": 0,
    "interval_step": 0.2,
    "interval_max": 0.5,
}
_BATCH = 100

JOB_TASKS = {
    "inspection": INSPECT_DATASET_TASK,
    "evaluation": EVALUATE_CHECKPOINT_TASK,
    "preparation": PREPARE_DATASET_TASK,
    "digest": DIGEST_INPUT_TASK,
}


def make_celery(broker_url: str) -> Celery:
    """A send-only Celery app: it never imports the worker's tasks, it names them."""
    broker, options = broker_options(broker_url)
    app = Celery("trainctl-service", broker=broker, set_as_current=False)
    app.conf.update(
        broker_transport_options={**_PUBLISH_FAILOVER, **options},
        broker_connection_timeout=2,
        task_publish_retry=False,
        task_serializer="json",
        accept_content=["json"],
    )
    return app


def dispatch_pending(*, session_factory: sessionmaker[Session], celery: Celery, queue: str) -> int:
    """Send every unsent outbox row (oldest first) and mark it sent; returns how many went out.
    A placed attempt's message goes to its worker's own queue, a job's to `queue`.
    Stops at the first broker error, which is logged: the rows stay for the next pass."""
    sent = 0
    placed_queue = _placed_queue
    with session_factory() as session:
        while True:
            # SKIP LOCKED (Postgres): two service processes do not send the same rows at once.
            rows = session.scalars(
                select(OutboxMessage)
                .where(OutboxMessage.sent_at.is_(None))
                .order_by(OutboxMessage.id)
                .limit(_BATCH)
                .with_for_update(skip_locked=True)
            ).all()
            # By the database's clock, as the redispatch pass judges it (one read a batch).
            now = database_now(session) if rows else None
            for row in rows:
                if row.attempt_id is not None and row.queue is None:
                    row.sent_at = now  # from before placement: placement sends the attempt
                    continue
                task, args = message_of(session, row)
                target = placed_queue(row, queue)
                try:
                    if row.member is None:
                        celery.send_task(task, args=args, queue=target)
                    else:  # a member of a multi-node attempt (contracts.dispatch)
                        celery.send_task(
                            task, args=args, kwargs={"member": row.member}, queue=target
                        )
                # Any failure to send (kombu's errors, or a transport's own such as redis-py's
                # ConnectionError, which is no OSError) leaves the row for the next pass.
                except Exception as err:
                    log.warning(
                        "could not send %s %s to queue %r (%s); it stays in the outbox "
                        "and is retried",
                        "attempt" if row.attempt_id is not None else "job",
                        args[0],
                        target,
                        err,
                    )
                    session.commit()
                    return sent
                row.sent_at = now
                if row.job_id is not None:
                    _count_delivery(session, row.job_id)
                sent += 1
            session.commit()
            if len(rows) < _BATCH:
                return sent


def _count_delivery(session: Session, job_id: str) -> None:
    # In SQL: a worker's start or finish may write the row meanwhile.
    session.execute(
        update(Job)
        .where(Job.id == job_id)
        .values(deliveries=Job.deliveries + 1)
        .execution_options(synchronize_session=False)
    )


def _placed_queue(row: OutboxMessage, queue: str) -> str:
    """Where a row's message goes: a placed attempt's to its worker's own queue, a job's to
    the base queue."""
    return row.queue or queue


def message_of(session: Session, row: OutboxMessage) -> tuple[str, list[Any]]:
    """(task name, args) of an outbox row: `run_phase(attempt_id)`, or a job's task with
    `(job_id, request)` (contracts.dispatch)."""
    if row.attempt_id is not None:
        return RUN_PHASE_TASK, [row.attempt_id]
    job = session.get(Job, row.job_id)
    # The foreign key (ON DELETE CASCADE) removes the row with its job.
    assert job is not None, f"outbox row {row.id} names no job"
    return JOB_TASKS[job.kind], [job.id, job.request]


def redispatch_unclaimed(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    after: float,
    lease_seconds: float,
    queue: str = "",
) -> list[str]:
    """Take back the placement of every queued attempt whose worker died after it was placed
    on, or left its message unclaimed for `after` seconds (the broker lost it): the next
    placement pass places it again, on a live worker, with new messages. Counted on the
    attempt (`redispatches`). Returns the ids; the caller dispatches (which places first).
    `queue` is unused: a placement names its worker."""
    del queue
    return unplace_stale(
        session_factory=session_factory, now=now, after=after, lease_seconds=lease_seconds
    )


def _database_now(session_factory: sessionmaker[Session]) -> datetime:
    with session_factory() as session:
        return database_now(session)


class OutboxPump(Periodic):
    """Places queued attempts (service.workers.placement.place) and sends the outbox after
    commits (`dispatch`) and every `interval` seconds in a thread."""

    name = "outbox"

    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        celery: Celery,
        queue: str,
        interval: float,
        lease_seconds: float | None = None,
    ) -> None:
        super().__init__(interval=interval)
        self.session_factory = session_factory
        self.celery = celery
        self.queue = queue
        # None: no placement pass (a pump that only sends, as some tests build it).
        self.lease_seconds = lease_seconds
        # One pass at a time per process: a concurrent pass would only send duplicates.
        self._lock = threading.Lock()

    def dispatch(self) -> int:
        with self._lock:
            try:
                if self.lease_seconds is not None:
                    unplace_stale(
                        session_factory=self.session_factory,
                        now=_database_now(self.session_factory),
                        after=None,
                        lease_seconds=self.lease_seconds,
                    )
                    place(
                        session_factory=self.session_factory,
                        lease_seconds=self.lease_seconds,
                        queue=self.queue,
                    )
                return dispatch_pending(
                    session_factory=self.session_factory, celery=self.celery, queue=self.queue
                )
            except SQLAlchemyError as err:
                # The database being down is reported by /readyz; one line per pass is enough.
                log.warning("outbox pass failed (%s); retrying in %.1f s", err, self.interval)
                return 0

    def run_once(self) -> int:
        return self.dispatch()

    def close(self) -> None:
        self.stop()
        self.celery.close()

    def __repr__(self) -> str:
        return f"OutboxPump(queue={self.queue!r}, interval={self.interval})"
