"""The public view of runs: pages of runs by key (`GET /runs`), and each run with its attempts,
latest checkpoint, tags and, while its attempt waits, why no live worker takes it."""

from __future__ import annotations

import base64
import json
from collections import defaultdict
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import and_, exists, func, or_, select
from sqlalchemy.orm import Session

from contracts.api import AttemptPublic, CheckpointSummary, InitialCheckpointFrom, RunPublic
from contracts.reports import Preparing
from contracts.workflow import Plan
from service.checkpoints.registry import USABLE
from service.lifecycle import AttemptStatus, RunStatus, budget_use, recovery_seconds
from service.models import Attempt, AttemptMember, Checkpoint, Run, RunTag, utcnow
from service.workers.fleet import LiveCapacity, largest_live_worker


class RunsCursor(NamedTuple):
    """Where a page of `GET /runs` ended: its last run's (created_at, id)."""

    created_at: datetime
    id: str

    def encode(self) -> str:
        """Opaque to clients: base64url of `[created_at, id]`."""
        text = json.dumps([self.created_at.isoformat(), self.id], separators=(",", ":"))
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def parse(cls, cursor: str) -> RunsCursor:
        """The cursor `encode` gave out, or ValueError saying what to do instead."""
        try:
            created_at, run_id = json.loads(
                base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
            )
            parsed = cls(datetime.fromisoformat(created_at), run_id)
            if parsed.created_at.tzinfo is None or not isinstance(run_id, str):
                raise ValueError(cursor)
        except (ValueError, TypeError) as err:
            raise ValueError(
                "is not a cursor this API gave out; pass the `next_cursor` of the previous "
                "page as it came, or leave it out to start from the newest run"
            ) from err
        return parsed


def _like_pattern(text: str) -> str:
    """`text` as a LIKE pattern matching it anywhere, its own % and _ taken literally."""
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def list_runs(
    *,
    session: Session,
    limit: int,
    status: RunStatus | None,
    after: RunsCursor | None = None,
    owner_id: str | None = None,
    tags: list[str] | None = None,
    name: str | None = None,
) -> tuple[list[Run], int, RunsCursor | None]:
    """A page of runs, newest first (created_at descending, then id), starting after `after`;
    the number of runs matching the filters (all pages); and the cursor of the next page, None
    after the last. Paging is by key, so runs created meanwhile (newer than any page read)
    neither repeat nor shift a run into the next page. With `owner_id`, only that owner's runs
    (pages and count); with `status`, runs in it; with `tags`, runs carrying every one of
    them; with `name`, runs whose name holds it, whatever the case."""
    query = select(Run)
    count = select(func.count()).select_from(Run)
    conditions: list[Any] = []
    if owner_id is not None:
        conditions.append(Run.owner_id == owner_id)
    if status is not None:
        conditions.append(Run.status == status)
    for tag in sorted(set(tags or [])):
        conditions.append(Run.id.in_(select(RunTag.run_id).where(RunTag.tag == tag)))
    if name:
        conditions.append(Run.name.ilike(_like_pattern(name), escape="\\"))
    if conditions:
        query = query.where(*conditions)
        count = count.where(*conditions)
    if after is not None:
        # The first condition alone is what an index range on created_at can start from.
        query = query.where(
            Run.created_at <= after.created_at,
            or_(
                Run.created_at < after.created_at,
                and_(Run.created_at == after.created_at, Run.id > after.id),
            ),
        )
    runs = list(session.scalars(query.order_by(Run.created_at.desc(), Run.id).limit(limit + 1)))
    following = None
    if len(runs) > limit:
        runs = runs[:limit]
        following = RunsCursor(runs[-1].created_at, runs[-1].id)
    return runs, session.scalar(count) or 0, following


def runs_public(
    *, session: Session, runs: list[Run], lease_seconds: float, queue: str
) -> list[RunPublic]:
    """Public views of runs, with attempts and latest checkpoints loaded in two queries (and
    a third, when one waits in the queue, for the largest worker of `queue` heard from within
    `lease_seconds`: a queued attempt waits for a worker while none is live or none owns the
    devices it needs)."""
    ids = [run.id for run in runs]
    attempts: dict[str, list[Attempt]] = defaultdict(list)
    latest: dict[str, Checkpoint] = {}
    tags = run_tags(session=session, run_ids=ids)
    if ids:
        for attempt in session.scalars(
            select(Attempt).where(Attempt.run_id.in_(ids)).order_by(Attempt.number)
        ):
            attempts[attempt.run_id].append(attempt)
        newest = (
            select(Checkpoint.run_id, func.max(Checkpoint.step).label("step"))
            .where(Checkpoint.run_id.in_(ids), Checkpoint.status == USABLE)
            .group_by(Checkpoint.run_id)
            .subquery()
        )
        for checkpoint in session.scalars(
            select(Checkpoint).join(
                newest,
                (Checkpoint.run_id == newest.c.run_id) & (Checkpoint.step == newest.c.step),
            )
        ):
            latest[checkpoint.run_id] = checkpoint
    now = utcnow()
    queued = {
        run.id: attempts[run.id][-1]
        for run in runs
        if attempts[run.id] and attempts[run.id][-1].status == AttemptStatus.QUEUED
    }
    capacity = (
        largest_live_worker(session=session, now=now, lease_seconds=lease_seconds, queue=queue)
        if queued
        else None
    )
    waiting = {
        run_id: reason
        for run_id, attempt in queued.items()
        if (reason := waiting_reason(attempt, capacity, queue=queue)) is not None
    }
    by_id = {run.id: run for run in runs}
    positions = {
        run_id: queue_position(session, attempt, by_id[run_id].priority)
        for run_id, attempt in queued.items()
    }
    return [
        _run_public(
            run,
            attempts[run.id],
            latest.get(run.id),
            now,
            waiting.get(run.id),
            tags[run.id],
            positions.get(run.id),
        )
        for run in runs
    ]


def queue_position(session: Session, attempt: Attempt, priority: int) -> int:
    """Its place in GET /queue's order: attempts placed (not claimed yet) first, then the
    unplaced ones by service.workers.scheduler's order (priority, queued time, id). One count
    query."""
    placed = exists().where(AttemptMember.attempt_id == Attempt.id)
    mine = attempt.queued_at or utcnow()
    if session.scalar(select(exists().where(AttemptMember.attempt_id == attempt.id))):
        ahead: Any = placed & (Attempt.queued_at < mine)
    else:
        ahead = or_(
            placed,
            Run.priority > priority,
            and_(
                Run.priority == priority,
                or_(
                    Attempt.queued_at < mine,
                    and_(Attempt.queued_at == mine, Attempt.id < attempt.id),
                ),
            ),
        )
    count = session.scalar(
        select(func.count())
        .select_from(Attempt)
        .join(Run, Run.id == Attempt.run_id)
        .where(Attempt.status == AttemptStatus.QUEUED.value, Attempt.id != attempt.id, ahead)
    )
    return 1 + int(count or 0)


def run_tags(*, session: Session, run_ids: list[str]) -> dict[str, list[str]]:
    """Each run's tags, sorted, in one query (an empty list for a run without any)."""
    found: dict[str, list[str]] = {run_id: [] for run_id in run_ids}
    if run_ids:
        rows = session.execute(
            select(RunTag.run_id, RunTag.tag)
            .where(RunTag.run_id.in_(run_ids))
            .order_by(RunTag.run_id, RunTag.tag)
        )
        for run_id, tag in rows:
            found[run_id].append(tag)
    return found


def _devices(count: int) -> str:
    return f"{count} device{'s' if count != 1 else ''}"


def waiting_reason(attempt: Attempt, capacity: LiveCapacity | None, *, queue: str) -> str | None:
    """Why no live worker can take a queued attempt, in a sentence; None when one can.
    `capacity`: the largest live worker of `queue` (service.workers.fleet.largest_live_worker)."""
    if capacity is None:
        return (
            f"no live worker has been seen: none of queue {queue!r} was heard from within the "
            "lease period"
        )
    if capacity.devices >= attempt.devices:
        return None
    kind = f" ({capacity.device_kind})" if capacity.device_kind else ""
    return (
        f"attempt {attempt.number} needs {_devices(attempt.devices)}; the most a live worker "
        f"has is {capacity.devices}{kind}"
    )


def run_public(*, session: Session, run: Run, lease_seconds: float, queue: str) -> RunPublic:
    return runs_public(session=session, runs=[run], lease_seconds=lease_seconds, queue=queue)[0]


def _placement_reason(attempts: list[Attempt]) -> str | None:
    newest = attempts[-1] if attempts else None
    if newest is None or newest.status != AttemptStatus.QUEUED:
        return None
    return newest.waiting_reason


def _preparing(attempts: list[Attempt]) -> Preparing | None:
    newest = attempts[-1] if attempts else None
    if newest is None or newest.status != AttemptStatus.RUNNING or newest.preparing_file is None:
        return None
    return Preparing(file=newest.preparing_file, fraction=newest.preparing_fraction or 0.0)


def _initial_from(run: Run) -> InitialCheckpointFrom | None:
    """The run and step (and the eval set, for a best one) of another run's checkpoint the run
    started from, as its signature components keep them."""
    stored = (run.signature_components or {}).get("initial_checkpoint") or {}
    if stored.get("run") is None or stored.get("step") is None:
        return None
    return InitialCheckpointFrom(run=stored["run"], step=stored["step"], best=stored.get("best"))


def _run_public(
    run: Run,
    attempts: list[Attempt],
    latest: Checkpoint | None,
    now: datetime,
    waiting: str | None,
    tags: list[str],
    position: int | None = None,
) -> RunPublic:
    run_plan = Plan.model_validate(run.plan)
    phase = (
        run_plan.phases[run.phase_index].name
        if 0 <= run.phase_index < len(run_plan.phases)
        else None
    )
    use = budget_use(attempts)
    return RunPublic(
        id=run.id,
        name=run.name,
        tags=tags,
        note=run.note,
        workflow_id=run.workflow_id,
        status=RunStatus(run.status),
        cause=run.cause,
        message=run.message,
        phase=phase,
        phase_index=run.phase_index,
        step=run.step,
        total_steps=run.total_steps,
        signature=run.signature,
        plan=run_plan,
        initial_checkpoint=run.initial_checkpoint,
        initial_checkpoint_from=_initial_from(run),
        latest_checkpoint=None if latest is None else CheckpointSummary.model_validate(latest),
        attempts=[AttemptPublic.model_validate(a) for a in attempts],
        restarts=use.restarts,
        max_restarts=run.max_restarts,
        preemptions=use.preemptions,
        max_preemptions=run.max_preemptions,
        recovery_seconds=recovery_seconds(attempts, now),
        pause_requested_at=run.pause_requested_at,
        devices=run.devices,
        waiting_for_worker=waiting is not None,
        # No worker could take it at all, else why the last placement pass left it waiting
        # (the owner's quota, behind higher priorities, a gang waiting for free workers).
        waiting_reason=waiting or _placement_reason(attempts),
        priority=run.priority,
        queue_position=position,
        preparing=_preparing(attempts),
        created_at=run.created_at,
        updated_at=run.updated_at,
        finished_at=run.finished_at,
    )
