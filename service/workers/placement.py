"""The placement pass: read the queue, the live workers and the owners' quotas, run the pure
decision (service.workers.scheduler.decide), and write what it decided, in one transaction.

- A placed attempt gets one `attempt_members` row per member (the worker's key) and one outbox
  row per member, addressed to that worker's own queue (contracts.dispatch.worker_queue; kwarg
  `member=k` when the attempt has more than one node). The outbox pump sends them after the
  commit, so a broker outage delays and never loses a placement.
- A preemption sets the running attempt's `yield_requested_at`: its heartbeat answers `pause`,
  the worker checkpoints and finishes `paused`, and service.lifecycle.settle_attempt queues the
  run again (cause `priority`, no budget charged).
- Every queued attempt left waiting gets the decision's reason (`waiting_reason`), written only
  when it changed.

Replicas take turns: the pass first UPDATEs the one row of `scheduler_state`, which holds a row
lock on Postgres (a write lock on SQLite) until the commit, so two passes never place one
attempt twice or one worker for two attempts. The pass runs after anything that queues an
attempt or frees a worker (OutboxPump.dispatch: run creation, a finish, a resume, the reaper),
after an idle worker's ping, and every outbox interval. Costs a handful of queries over queued
attempts, live workers and active attempts (bench/placement.py: a few milliseconds at 100
queued).

A worker that dies after it was placed on never claims: `unplace_stale` takes the members of a
queued attempt off a worker no longer live (before every placement pass) or one that left the
message unclaimed for TRAINCTL_REDISPATCH_SECONDS (the reaper's pass), and the next pass places
it again.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, exists, func, or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from contracts.api import QueuedAttemptPublic, QueuePublic
from contracts.dispatch import worker_queue
from service.db import database_now, rowcount
from service.lifecycle import AttemptStatus
from service.models import (
    ApiToken,
    Attempt,
    AttemptMember,
    OutboxMessage,
    Run,
    SchedulerState,
    Worker,
)
from service.workers.scheduler import Active, Decision, Machine, Queued, decide

log = logging.getLogger(__name__)

_QUEUED = AttemptStatus.QUEUED.value
_RUNNING = AttemptStatus.RUNNING.value


@dataclass(frozen=True)
class Snapshot:
    """What a decision is made over, read in one transaction."""

    queued: list[Queued]
    active: list[Active]
    machines: list[Machine]
    quotas: dict[str, int | None]


def _lock(session: Session) -> None:
    won = session.execute(
        update(SchedulerState)
        .where(SchedulerState.id == 1)
        .values(passes=SchedulerState.passes + 1)
        .execution_options(synchronize_session=False)
    )
    if rowcount(won) != 1:  # the row migration 0019 inserts, deleted by hand
        session.add(SchedulerState(id=1, passes=1))
        session.flush()


def snapshot(*, session: Session, now: datetime, lease_seconds: float, queue: str) -> Snapshot:
    """The queue (unplaced queued attempts), the active attempts (placed or running, with
    their workers), the live workers of `queue` that have their own queue, and the quotas of
    the owners involved."""
    since = now - timedelta(seconds=lease_seconds)
    placed = exists().where(AttemptMember.attempt_id == Attempt.id)
    queued = [
        Queued(
            id=a.id,
            run_id=a.run_id,
            priority=priority,
            queued_at=a.queued_at or now,
            owner=owner,
            devices=a.devices,
            nodes=a.nodes,
        )
        for a, priority, owner in session.execute(
            select(Attempt, Run.priority, Run.owner_id)
            .join(Run, Run.id == Attempt.run_id)
            .where(Attempt.status == _QUEUED, ~placed)
        )
    ]
    members: dict[str, list[tuple[int, str]]] = defaultdict(list)
    rows = session.execute(
        select(Attempt, Run.priority, Run.owner_id)
        .join(Run, Run.id == Attempt.run_id)
        .where(or_(Attempt.status == _RUNNING, (Attempt.status == _QUEUED) & placed))
    ).all()
    ids = [a.id for a, _, _ in rows]
    if ids:
        for m in session.scalars(select(AttemptMember).where(AttemptMember.attempt_id.in_(ids))):
            members[m.attempt_id].append((m.member, m.worker_id))
    # A running attempt claimed outside placement holds the worker its claim names.
    claimed_by = {
        attempt_id: key
        for attempt_id, key in session.execute(
            select(Worker.attempt_id, Worker.key).where(
                Worker.attempt_id.in_(ids), Worker.key.is_not(None)
            )
        )
        if key is not None
    }
    active = []
    for a, priority, owner in rows:
        workers = tuple(k for _, k in sorted(members.get(a.id, [])))
        if not workers and a.id in claimed_by:
            workers = (claimed_by[a.id],)
        active.append(
            Active(
                id=a.id,
                run_id=a.run_id,
                priority=priority,
                placed_at=a.claimed_at or a.queued_at or now,
                owner=owner,
                devices=a.devices,
                nodes=a.nodes,
                workers=workers,
                yielding=a.yield_requested_at is not None,
                running=a.status == _RUNNING,
            )
        )
    busy = {k for a in active for k in a.workers}
    # A worker that handed an attempt back on a preemption notice (SIGTERM) is shutting down:
    # it still pings for a moment, but a message sent to its own queue now would wait there
    # for good (a restarted worker is a new key). Per live worker, by its placements' index.
    leaving = exists().where(
        AttemptMember.worker_id == Worker.key,
        AttemptMember.attempt_id == Attempt.id,
        Attempt.status == AttemptStatus.PREEMPTED.value,
    )
    machines = [
        Machine(key=key, devices=devices or 1, busy=key in busy)
        for key, devices in session.execute(
            select(Worker.key, Worker.devices).where(
                Worker.last_seen_at >= since,
                Worker.key.is_not(None),
                ~leaving,
                or_(Worker.queue.is_(None), Worker.queue == queue),
            )
        )
        if key is not None
    ]
    owners = {q.owner for q in queued if q.owner is not None}
    quotas: dict[str, int | None] = {}
    if owners:
        rows_ = session.execute(
            select(ApiToken.id, ApiToken.max_devices).where(ApiToken.id.in_(owners))
        )
        quotas = {token_id: cap for token_id, cap in rows_}
    return Snapshot(queued=queued, active=active, machines=machines, quotas=quotas)


def place(*, session_factory: sessionmaker[Session], lease_seconds: float, queue: str) -> Decision:
    """One placement pass (see the module docstring); commits. Returns the decision."""
    with session_factory() as session:
        _lock(session)
        now = database_now(session)
        state = snapshot(session=session, now=now, lease_seconds=lease_seconds, queue=queue)
        decision = decide(
            queued=state.queued, active=state.active, machines=state.machines, quotas=state.quotas
        )
        nodes = {q.id: q.nodes for q in state.queued}
        for p in decision.placements:
            for k, key in enumerate(p.workers):
                session.add(
                    AttemptMember(attempt_id=p.attempt_id, member=k, worker_id=key, placed_at=now)
                )
                session.add(
                    OutboxMessage(
                        attempt_id=p.attempt_id,
                        queue=worker_queue(queue, key),
                        member=k if nodes[p.attempt_id] > 1 else None,
                    )
                )
        for y in decision.preemptions:
            session.execute(
                update(Attempt)
                .where(
                    Attempt.id == y.attempt_id,
                    Attempt.status == _RUNNING,
                    Attempt.yield_requested_at.is_(None),
                )
                .values(yield_requested_at=now)
                .execution_options(synchronize_session=False)
            )
            log.info(
                "attempt %s (run %s) is told to checkpoint and yield to the higher-priority "
                "attempt %s",
                y.attempt_id,
                y.run_id,
                y.for_attempt,
            )
        reasons = {
            w.attempt_id: (None if w.reason == "placed" else w.reason) for w in decision.order
        }
        if reasons:
            found = session.execute(
                select(Attempt.id, Attempt.waiting_reason).where(Attempt.id.in_(reasons))
            )
            stored = {attempt_id: reason for attempt_id, reason in found}
            changed = [
                {"id": i, "waiting_reason": r} for i, r in reasons.items() if stored.get(i) != r
            ]
            if changed:
                session.execute(update(Attempt), changed)
        session.commit()
    for p in decision.placements:
        log.info("attempt %s placed on %s", p.attempt_id, ", ".join(p.workers))
    return decision


def holds_placement(*, session: Session, key: str) -> bool:
    """Whether the worker `key` has an attempt placed on it that is queued or running."""
    return bool(
        session.scalar(
            select(func.count())
            .select_from(AttemptMember)
            .join(Attempt, Attempt.id == AttemptMember.attempt_id)
            .where(AttemptMember.worker_id == key, Attempt.status.in_((_QUEUED, _RUNNING)))
        )
    )


def unplace_stale(
    *,
    session_factory: sessionmaker[Session],
    now: datetime,
    after: float | None,
    lease_seconds: float,
) -> list[str]:
    """Take back the placement of every queued attempt whose worker is no longer live (it died
    after it was placed on) or left its message unclaimed for `after` seconds (the broker lost
    it, or the worker hangs), so the next pass places it again; counted on the attempt
    (`redispatches`). `after` None: only those of workers no longer live (every placement
    pass takes those back, so an attempt placed on a worker that was going away as it was
    placed waits a lease, not a reaper interval). Returns the ids taken back; the caller runs
    a pass."""
    since = now - timedelta(seconds=lease_seconds)
    live = exists().where(Worker.key == AttemptMember.worker_id, Worker.last_seen_at >= since)
    stale = ~live
    if after is not None:
        stale = or_(stale, AttemptMember.placed_at <= now - timedelta(seconds=after))
    with session_factory() as session:
        _lock(session)
        due = list(
            session.execute(
                select(Attempt.id, Attempt.redispatches)
                .join(AttemptMember, AttemptMember.attempt_id == Attempt.id)
                .where(Attempt.status == _QUEUED, stale)
                .distinct()
            )
        )
        for attempt_id, count in due:
            session.execute(delete(AttemptMember).where(AttemptMember.attempt_id == attempt_id))
            session.execute(
                update(Attempt)
                .where(Attempt.id == attempt_id)
                .values(redispatches=count + 1)
                .execution_options(synchronize_session=False)
            )
            log.warning(
                "attempt %s was placed but not claimed (its worker is gone, or its message was "
                "lost); it is placed again (re-send %d)",
                attempt_id,
                count + 1,
            )
        session.commit()
    return [attempt_id for attempt_id, _ in due]


def queue_view(
    *,
    session: Session,
    lease_seconds: float,
    queue: str,
    owner_id: str | None = None,
    limit: int = 500,
) -> QueuePublic:
    """Queued attempts in placement order (placed ones, not claimed yet, first with reason
    "placed"), each with why it waits as a pass would decide now; read-only (no lock). With
    `owner_id`, only that owner's attempts are listed (positions stay the global ones)."""
    now = database_now(session)
    state = snapshot(session=session, now=now, lease_seconds=lease_seconds, queue=queue)
    decision = decide(
        queued=state.queued, active=state.active, machines=state.machines, quotas=state.quotas
    )
    placed = [a for a in state.active if not a.running]
    ids = [w.attempt_id for w in decision.order] + [a.id for a in placed]
    info = {
        a.id: (a, name, priority, owner)
        for a, name, priority, owner in session.execute(
            select(Attempt, Run.name, Run.priority, Run.owner_id)
            .join(Run, Run.id == Attempt.run_id)
            .where(Attempt.id.in_(ids))
        )
    }
    entries = [(a.id, "placed") for a in sorted(placed, key=lambda a: a.placed_at)]
    entries += [(w.attempt_id, w.reason) for w in decision.order]
    out = []
    for position, (attempt_id, reason) in enumerate(entries, start=1):
        attempt, name, priority, owner = info[attempt_id]
        if owner_id is not None and owner != owner_id:
            continue
        out.append(
            QueuedAttemptPublic(
                position=position,
                attempt_id=attempt_id,
                run_id=attempt.run_id,
                run_name=name,
                priority=priority,
                owner_id=owner,
                devices=attempt.devices,
                nodes=attempt.nodes,
                queued_at=attempt.queued_at,
                reason=reason,
            )
        )
    return QueuePublic(attempts=out[:limit], count=len(out))
