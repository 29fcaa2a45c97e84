"""The workers the service has heard from: one row per worker process (hostname, pid), kept
fresh by its claims, its heartbeats and its own pings. A worker is live while it was heard
from within one lease period: the time after which the service gives up on a silent worker's
attempt is also the time after which it stops counting the worker as there."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import exists, func, or_, select
from sqlalchemy.orm import Session

from contracts.api import WorkerAssignment, WorkerPublic, WorkersPublic
from service.db import insert_for
from service.lifecycle import AttemptStatus
from service.models import Attempt, AttemptMember, Run, Worker

# What a worker first heard from by a claim or heartbeat (which carry no version) shows
# until its ping says.
UNKNOWN_VERSION = "unknown"


def note_worker(
    *,
    session: Session,
    hostname: str,
    pid: int,
    now: datetime,
    version: str | None = None,
    queue: str | None = None,
    token_id: str | None = None,
    attempt_id: str | None = None,
    devices: int | None = None,
    device_kind: str | None = None,
    key: str | None = None,
    address: str | None = None,
) -> None:
    """Record that the worker (hostname, pid) was heard from at `now`: inserted the first time,
    else updated; a field not given keeps what was stored (a claim says nothing of the
    worker's version, queue or devices; its ping does). The caller commits. One statement
    (INSERT ... ON CONFLICT), so concurrent notes of one worker never collide."""
    given = {
        "version": version,
        "queue": queue,
        "token_id": token_id,
        "attempt_id": attempt_id,
        "devices": devices,
        "device_kind": device_kind,
        "key": key,
        "address": address,
    }
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    insert = insert_for(session, Worker).values(
        hostname=hostname,
        pid=pid,
        first_seen_at=now,
        last_seen_at=now,
        **{**changes, "version": version or UNKNOWN_VERSION},
    )
    session.execute(
        insert.on_conflict_do_update(
            index_elements=[Worker.hostname, Worker.pid],
            set_={**changes, "last_seen_at": now},
        )
    )


def note_attempt_worker(
    *,
    session: Session,
    attempt_id: str,
    now: datetime,
    token_id: str | None = None,
    member: int = 0,
) -> None:
    """note_worker for the worker that holds the attempt (or its member `member` > 0 of an
    attempt across many workers), as its row names it (claims and heartbeats carry no version
    or queue). Nothing when the attempt names no worker."""
    attempt = session.get(Attempt, attempt_id)
    if attempt is None:
        return
    hostname, pid = attempt.worker_hostname, attempt.worker_pid
    if member > 0:
        row = session.get(AttemptMember, (attempt_id, member))
        hostname, pid = (None, None) if row is None else (row.worker_hostname, row.worker_pid)
    if hostname is None or pid is None:
        return
    note_worker(
        session=session,
        hostname=hostname,
        pid=pid,
        now=now,
        token_id=token_id,
        attempt_id=attempt.id,
    )


def _serves(queue: str) -> Any:
    # A worker heard from only by its claims has no queue yet; it took this service's message.
    return or_(Worker.queue.is_(None), Worker.queue == queue)


@dataclass(frozen=True)
class LiveCapacity:
    """The most devices a live worker of a queue owns, and their kind (None: not said)."""

    devices: int
    device_kind: str | None


def largest_live_worker(
    *, session: Session, now: datetime, lease_seconds: float, queue: str
) -> LiveCapacity | None:
    """The most devices one worker of `queue` heard from within the last lease period owns
    (a worker heard from only by its claims counts as one device), with their kind; None when
    no worker of the queue is live. One query."""
    since = now - timedelta(seconds=lease_seconds)
    owned = func.coalesce(Worker.devices, 1)
    found = session.execute(
        select(owned, Worker.device_kind)
        .where(Worker.last_seen_at >= since, _serves(queue))
        .order_by(owned.desc(), Worker.last_seen_at.desc(), Worker.id.desc())
        .limit(1)
    ).first()
    return None if found is None else LiveCapacity(devices=int(found[0]), device_kind=found[1])


def largest_idle_worker(
    *, session: Session, now: datetime, lease_seconds: float, queue: str
) -> int | None:
    """The most devices one live worker of `queue` that runs no attempt owns (its last claim's
    attempt, if any, has ended); None when no live worker of the queue is idle. A worker busy
    with a job counts as idle: the service does not know which worker runs a job. One query."""
    since = now - timedelta(seconds=lease_seconds)
    busy = exists().where(
        Attempt.id == Worker.attempt_id, Attempt.status == AttemptStatus.RUNNING.value
    )
    most = session.scalar(
        select(func.max(func.coalesce(Worker.devices, 1))).where(
            Worker.last_seen_at >= since, _serves(queue), ~busy
        )
    )
    return None if most is None else int(most)


def list_workers(
    *,
    session: Session,
    now: datetime,
    lease_seconds: float,
    limit: int,
    owner_id: str | None = None,
) -> WorkersPublic:
    """The `limit` workers heard from most recently, newest first, each with the attempt it
    is running (None when it runs none), and how many there are in all and live. With
    `owner_id`, the attempt and run of another owner's run are not named: the worker is only
    `busy`."""
    since = now - timedelta(seconds=lease_seconds)
    running = (
        select(Attempt.id, Attempt.run_id, Run.owner_id)
        .join(Run, Run.id == Attempt.run_id)
        .where(Attempt.status == AttemptStatus.RUNNING.value)
        .subquery()
    )
    rows = session.execute(
        select(Worker, running.c.run_id, running.c.owner_id)
        .outerjoin(running, running.c.id == Worker.attempt_id)
        .order_by(Worker.last_seen_at.desc(), Worker.id.desc())
        .limit(limit)
    ).all()
    keys = [w.key for w, _, _ in rows if w.key is not None]
    placed = {}
    if keys:
        for member, status, run_id_, owner_, priority in session.execute(
            select(AttemptMember, Attempt.status, Run.id, Run.owner_id, Run.priority)
            .join(Attempt, Attempt.id == AttemptMember.attempt_id)
            .join(Run, Run.id == Attempt.run_id)
            .where(
                AttemptMember.worker_id.in_(keys),
                Attempt.status.in_((AttemptStatus.QUEUED.value, AttemptStatus.RUNNING.value)),
            )
        ):
            seen = owner_id is None or owner_ == owner_id
            placed[member.worker_id] = WorkerAssignment(
                attempt_id=member.attempt_id if seen else None,
                run_id=run_id_ if seen else None,
                member=member.member,
                priority=priority,
                placed_at=member.placed_at,
                claimed=status == AttemptStatus.RUNNING.value,
            )
    workers = []
    for worker, run_id, run_owner in rows:
        shown = run_id is not None and (owner_id is None or run_owner == owner_id)
        workers.append(
            WorkerPublic(
                hostname=worker.hostname,
                pid=worker.pid,
                version=worker.version,
                queue=worker.queue,
                live=worker.last_seen_at >= since,
                first_seen_at=worker.first_seen_at,
                last_seen_at=worker.last_seen_at,
                busy=run_id is not None,
                attempt_id=worker.attempt_id if shown else None,
                run_id=run_id if shown else None,
                devices=worker.devices,
                device_kind=worker.device_kind,
                key=worker.key,
                assignment=placed.get(worker.key) if worker.key is not None else None,
            )
        )
    count = session.scalar(select(func.count()).select_from(Worker)) or 0
    live = (
        session.scalar(select(func.count()).select_from(Worker).where(Worker.last_seen_at >= since))
        or 0
    )
    return WorkersPublic(workers=workers, count=count, live=live)
