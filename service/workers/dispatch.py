"""Commit, then enqueue: the outbox pump.

An attempt's or a job's Celery message is first an outbox row, written in the transaction that
creates the attempt or job. After the commit, `dispatch_pending` sends unsent rows by task name
and marks them sent; a background thread repeats that every `outbox_interval_seconds`, so a
message whose send failed (broker down, process died) goes out later. An attempt's message goes
to the queue of its device count (contracts.dispatch.devices_queue: the base queue for one
device, `<queue>.devices-N` for more), which only workers that own N devices or more consume;
jobs go to the base queue, which every worker consumes. A row may be sent twice
(a crash between the send and the mark): workers tolerate that, because a claim has exactly one
winner and a job's first result is the one kept. Each send of a job's row counts as one of its
deliveries (`Job.deliveries`, its budget: service.workers.job.fail_exhausted_jobs).

A message the broker took can still be lost (Redis restarted without persistence, a queue
purged by hand), and its attempt would then stay queued for good: `redispatch_unclaimed`, run
by the reaper's pass, sends an attempt again when a worker that could take it has been free
for a while and nobody claimed it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from celery import Celery
from sqlalchemy import exists, or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from contracts.dispatch import (
    DIGEST_INPUT_TASK,
    EVALUATE_CHECKPOINT_TASK,
    INSPECT_DATASET_TASK,
    PREPARE_DATASET_TASK,
    RUN_PHASE_TASK,
    devices_queue,
)
from runtime.broker import broker_options
from service.db import database_now, rowcount
from service.lifecycle import AttemptStatus
from service.models import Attempt, Job, OutboxMessage
from service.workers.fleet import largest_idle_worker
from service.workers.periodic import Periodic

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
    An attempt's message goes to its device count's queue (`queue_of`), a job's to `queue`.
    Stops at the first broker error, which is logged: the rows stay for the next pass."""
    sent = 0
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
            queues = queue_of(session, rows, queue)
            # By the database's clock, as the redispatch pass judges it (one read a batch).
            now = database_now(session) if rows else None
            for row in rows:
                task, args = message_of(session, row)
                target = queues.get(row.id, queue)
                try:
                    celery.send_task(task, args=args, queue=target)
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


def queue_of(session: Session, rows: Sequence[OutboxMessage], queue: str) -> dict[int, str]:
    """{outbox row id: the queue its attempt's message goes to}, for the rows that name an
    attempt: `devices_queue(queue, attempt.devices)`. One query for all the rows."""
    attempt_ids = {row.attempt_id for row in rows if row.attempt_id is not None}
    if not attempt_ids:
        return {}
    found = session.execute(select(Attempt.id, Attempt.devices).where(Attempt.id.in_(attempt_ids)))
    devices = {attempt_id: count for attempt_id, count in found}
    return {
        row.id: devices_queue(queue, devices.get(row.attempt_id, 1))
        for row in rows
        if row.attempt_id is not None
    }


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
    queue: str,
) -> list[str]:
    """Queue a new outbox row for every attempt still queued `after` seconds after its last
    message went out (and none waits unsent), when a live worker of `queue` owning as many
    devices runs nothing (service.workers.fleet.largest_idle_worker): that worker would have claimed
    it, so its message is lost. With no such worker nothing is sent: a message waiting its turn
    behind busy workers is not lost, and copies of it would pile up in the broker. Each re-send
    is counted on the attempt, by a conditional UPDATE that also makes two replicas' passes
    send it once. Returns the ids sent again; the caller dispatches."""
    cutoff = now - timedelta(seconds=after)
    queued = Attempt.status == AttemptStatus.QUEUED.value
    with session_factory() as session:
        free = largest_idle_worker(
            session=session, now=now, lease_seconds=lease_seconds, queue=queue
        )
        if free is None:
            return []
        recent = exists().where(
            OutboxMessage.attempt_id == Attempt.id,
            or_(OutboxMessage.sent_at.is_(None), OutboxMessage.sent_at > cutoff),
        )
        due = session.execute(
            select(Attempt.id, Attempt.redispatches)
            .where(queued, Attempt.devices <= free, ~recent)
            .order_by(Attempt.id)
            .limit(_BATCH)
        ).all()
    sent = []
    for attempt_id, count in due:
        with session_factory() as session:
            won = session.execute(
                update(Attempt)
                .where(Attempt.id == attempt_id, queued, Attempt.redispatches == count)
                .values(redispatches=count + 1)
                .execution_options(synchronize_session=False)
            )
            if rowcount(won) != 1:  # claimed, superseded, or sent by another replica
                session.rollback()
                continue
            session.add(OutboxMessage(attempt_id=attempt_id))
            session.commit()
        log.warning(
            "attempt %s is still queued %.0f s after its message went out while a worker is "
            "free: the broker lost it; sent again (re-send %d)",
            attempt_id,
            after,
            count + 1,
        )
        sent.append(attempt_id)
    return sent


class OutboxPump(Periodic):
    """Dispatches after commits (`dispatch`) and every `interval` seconds in a thread."""

    name = "outbox"

    def __init__(
        self,
        *,
        session_factory: sessionmaker[Session],
        celery: Celery,
        queue: str,
        interval: float,
    ) -> None:
        super().__init__(interval=interval)
        self.session_factory = session_factory
        self.celery = celery
        self.queue = queue
        # One pass at a time per process: a concurrent pass would only send duplicates.
        self._lock = threading.Lock()

    def dispatch(self) -> int:
        with self._lock:
            try:
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
