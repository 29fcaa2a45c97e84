"""The run and attempt lifecycle: every status, every allowed transition, and what follows an
attempt's end. Every status write in the service goes through `move_run` or, for the
conditional UPDATEs that race, through `attempt_sources` / `run_sources` in their WHERE.

Runs:

    queued ──> running ──> succeeded            (the last phase's attempt succeeded)
      │           │ ↺ next phase, or a new claim
      │           ├──> recovering ──> running   (an attempt was preempted, lost or failed
      │           │        │                     with cause infrastructure; budget left)
      │           ├──> failed                   (a cause that is never retried, or budget spent)
      ├───────────┴────────┴──> paused ──> recovering (resume)
      └──────────────────────────────────> cancelled (from any unfinished state)
    failed, cancelled ──> recovering (resume)

Attempts: queued ──> running (claim) ──> succeeded | failed | preempted | paused (the worker's
finish), lost (the reaper: lease expired or progress stalled), superseded (pause, cancel, or a
resume that replaces it); a queued attempt may also be superseded. Every end is final.

`run.step` has one meaning: the last global step whose update the run's current attempt has
made (it can go down: an attempt that resumes from a checkpoint redoes the steps after it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from itertools import pairwise
from types import EllipsisType

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from contracts.api import RunStatus
from contracts.workflow import Workflow as WorkflowSpec
from service.db import rowcount
from service.models import Attempt, Run, Workflow, new_attempt_id, utcnow


class AttemptStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    PAUSED = "paused"
    LOST = "lost"
    SUPERSEDED = "superseded"


FINISHED_RUN = frozenset({RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED})
_UNFINISHED_RUN = frozenset(RunStatus) - FINISHED_RUN
_ATTEMPT_ENDS = frozenset(AttemptStatus) - {AttemptStatus.QUEUED, AttemptStatus.RUNNING}

RUN_TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.QUEUED: frozenset(
        {RunStatus.RUNNING, RunStatus.PAUSED, RunStatus.CANCELLED, RunStatus.FAILED}
    ),
    RunStatus.RUNNING: frozenset(_UNFINISHED_RUN | FINISHED_RUN) - {RunStatus.QUEUED},
    RunStatus.RECOVERING: frozenset(
        {
            RunStatus.RUNNING,
            RunStatus.RECOVERING,
            RunStatus.PAUSED,
            RunStatus.FAILED,
            RunStatus.CANCELLED,
        }
    ),
    RunStatus.PAUSED: frozenset({RunStatus.PAUSED, RunStatus.RECOVERING, RunStatus.CANCELLED}),
    RunStatus.SUCCEEDED: frozenset(),
    RunStatus.FAILED: frozenset({RunStatus.RECOVERING}),
    RunStatus.CANCELLED: frozenset({RunStatus.RECOVERING}),
}

ATTEMPT_TRANSITIONS: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    AttemptStatus.QUEUED: frozenset({AttemptStatus.RUNNING, AttemptStatus.SUPERSEDED}),
    AttemptStatus.RUNNING: _ATTEMPT_ENDS,
    **{end: frozenset() for end in _ATTEMPT_ENDS},
}

# The one error cause retried blindly (a new attempt while max_restarts lasts): the machine or
# the network failed, not the run. data, config, nan, oom, checkpoint, disk_full and
# signature_mismatch would fail the same way again (disk_full: resume once space is freed).
RETRIED_CAUSE = "infrastructure"
# Attempt ends that count against max_preemptions: the worker was taken away (or hung).
PREEMPTION_STATUSES = (AttemptStatus.PREEMPTED, AttemptStatus.LOST)
# The cause of an attempt that checkpointed and yielded its workers to a higher-priority one
# (it ends `paused`; never charged to a budget; its run is queued again on its own).
PRIORITY_CAUSE = "priority"


class IllegalTransition(RuntimeError):
    """A status write the lifecycle does not allow: a bug in the caller, never user input."""


def run_sources(to: RunStatus) -> tuple[str, ...]:
    """The run statuses from which `to` is allowed, for a conditional UPDATE's WHERE."""
    return tuple(s.value for s, targets in RUN_TRANSITIONS.items() if to in targets)


def attempt_sources(to: AttemptStatus) -> tuple[str, ...]:
    """The attempt statuses from which `to` is allowed, for a conditional UPDATE's WHERE."""
    return tuple(s.value for s, targets in ATTEMPT_TRANSITIONS.items() if to in targets)


def is_finished(run: Run) -> bool:
    return run.status in FINISHED_RUN


def move_run(
    run: Run,
    to: RunStatus,
    *,
    now: datetime | None = None,
    message: str | EllipsisType | None = ...,
    cause: str | None = None,
) -> None:
    """Set the run's status (and what goes with it) when the table allows it; raise
    `IllegalTransition` otherwise. `message` replaces the run's message when given. Finishing
    stamps `finished_at` and clears a pause request; leaving a finished state clears the old
    ending. Does not commit."""
    current = RunStatus(run.status)
    if to not in RUN_TRANSITIONS[current]:
        raise IllegalTransition(f"run {run.id}: {current} -> {to} is not a transition")
    now = now or utcnow()
    if current in FINISHED_RUN:
        run.finished_at = run.cause = None
    run.status = to.value
    if message is not ...:
        run.message = message
    if to in FINISHED_RUN:
        run.finished_at, run.pause_requested_at = now, None
        run.cause = cause if to is RunStatus.FAILED else None
    run.updated_at = now


def move_run_racing(
    session: Session, run: Run, to: RunStatus, *, message: str | None, now: datetime | None = None
) -> bool:
    """`move_run` as one conditional UPDATE from the statuses the table allows, for a writer
    that races a worker's finish (pause, cancel): the row locks that serialise them on
    Postgres do not exist on SQLite, where a finish committing between a read and this write
    would otherwise be overwritten. False when the run had moved on (finished, say). Does not
    commit; the caller refreshes `run`."""
    now = now or utcnow()
    values: dict[str, object] = {"status": to.value, "message": message, "updated_at": now}
    if to in FINISHED_RUN:
        values.update(finished_at=now, pause_requested_at=None, cause=None)
    won = session.execute(
        update(Run)
        .where(Run.id == run.id, Run.status.in_(run_sources(to)))
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    return rowcount(won) == 1


def end_attempt(
    attempt: Attempt,
    to: AttemptStatus,
    *,
    now: datetime,
    cause: str | None = None,
    message: str | None = None,
) -> None:
    """End an attempt the caller holds locked (its worker's finish, or a claim that finds its
    run paused), when the table allows it; raise `IllegalTransition` otherwise. Does not
    commit. Ends that race with other writers are conditional UPDATEs over
    `attempt_sources` instead."""
    current = AttemptStatus(attempt.status)
    if to not in ATTEMPT_TRANSITIONS[current]:
        raise IllegalTransition(f"attempt {attempt.id}: {current} -> {to} is not a transition")
    attempt.status, attempt.finished_at = to.value, now
    attempt.cause, attempt.message = cause, message


def set_run_step(run: Run, step: int) -> None:
    """`run.step` as the current attempt reports it (see the module docstring)."""
    run.step = step


@dataclass(frozen=True)
class BudgetUse:
    """What a run's attempts used of its budgets. Derived from the attempts each time (never
    a stored counter that could drift from them)."""

    restarts: int  # attempts failed with cause `infrastructure` (max_restarts)
    preemptions: int  # attempts preempted or lost (max_preemptions)


def budget_use(attempts: Iterable[Attempt]) -> BudgetUse:
    restarts = preemptions = 0
    for attempt in attempts:
        if attempt.status == AttemptStatus.FAILED and attempt.cause == RETRIED_CAUSE:
            restarts += 1
        elif attempt.status in PREEMPTION_STATUSES:
            preemptions += 1
    return BudgetUse(restarts=restarts, preemptions=preemptions)


def recovery_seconds(attempts: Iterable[Attempt], now: datetime) -> float:
    """Time lost to recovery: for each attempt that follows a preempted or lost one, from the
    previous attempt's end (a lost one's lease expiry: the service could not know sooner) to
    the new attempt's claim, or to `now` while it still waits for a worker."""
    ordered = sorted(attempts, key=lambda a: a.number)
    total = 0.0
    for previous, attempt in pairwise(ordered):
        if previous.status not in PREEMPTION_STATUSES:
            continue
        lost = previous.status == AttemptStatus.LOST
        ended = previous.lease_expires_at if lost else previous.finished_at
        if ended is None:
            continue
        if attempt.claimed_at is not None:
            resumed = attempt.claimed_at
        elif attempt.status == AttemptStatus.QUEUED:
            resumed = now
        else:
            continue
        total += max(0.0, (resumed - ended).total_seconds())
    return total


def phase_start(run: Run, phase_index: int) -> int:
    """The global step a phase starts after (its first step is this + 1)."""
    return int(run.plan["phases"][phase_index]["first_step"]) - 1


def attempt_devices(session: Session, run: Run, phase_index: int) -> int:
    """The torch.distributed ranks a new attempt of phase `phase_index` runs on: the count the
    run was last resumed with, else what its stored workflow asks for the phase."""
    if run.devices is not None:
        return run.devices
    workflow = session.get(Workflow, run.workflow_id)
    assert workflow is not None, f"run {run.id} names no stored workflow"
    return WorkflowSpec.model_validate(workflow.spec).phase_devices(phase_index)


def attempt_nodes(session: Session, run: Run, phase_index: int) -> int:
    """The workers a new attempt of phase `phase_index` runs on at once: what the stored
    workflow's phase asks (`resources.nodes`), 1 when it says nothing."""
    workflow = session.get(Workflow, run.workflow_id)
    assert workflow is not None, f"run {run.id} names no stored workflow"
    spec = WorkflowSpec.model_validate(workflow.spec)
    nodes = getattr(spec, "phase_nodes", None)
    return int(nodes(phase_index)) if callable(nodes) else 1


def add_attempt(*, session: Session, run: Run, phase_index: int) -> Attempt:
    """A queued attempt (next number, on `attempt_devices` x `attempt_nodes`). Its message is
    written by the placement pass that puts it on workers (service.workers.placement), which
    the caller runs after the commit (OutboxPump.dispatch). Does not commit."""
    last = session.scalar(select(func.max(Attempt.number)).where(Attempt.run_id == run.id))
    attempt = Attempt(
        id=new_attempt_id(),
        run_id=run.id,
        number=(last or 0) + 1,
        phase_index=phase_index,
        devices=attempt_devices(session, run, phase_index),
        nodes=attempt_nodes(session, run, phase_index),
        status=AttemptStatus.QUEUED.value,
        queued_at=utcnow(),
    )
    session.add(attempt)
    session.flush()
    return attempt


def newest_attempt(session: Session, run_id: str) -> Attempt | None:
    """The run's newest attempt as it is now, unlocked."""
    return session.scalars(
        select(Attempt)
        .where(Attempt.run_id == run_id)
        .order_by(Attempt.number.desc())
        .limit(1)
        .execution_options(populate_existing=True)
    ).first()


def lock_current_attempt(session: Session, run_id: str) -> Attempt | None:
    """The run's newest attempt, its row locked. Attempt first, then run: the worker protocol
    (report, finish, claim) locks in that order, so resume, pause and cancel do too and cannot
    deadlock with it."""
    attempt_id = session.scalar(
        select(Attempt.id).where(Attempt.run_id == run_id).order_by(Attempt.number.desc()).limit(1)
    )
    if attempt_id is None:
        return None
    return session.scalars(
        select(Attempt)
        .where(Attempt.id == attempt_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one()


def is_current(session: Session, attempt: Attempt) -> bool:
    """The run's newest attempt, and not already given up."""
    if attempt.status in (AttemptStatus.SUPERSEDED, AttemptStatus.LOST):
        return False
    newest = session.scalar(
        select(func.max(Attempt.number)).where(Attempt.run_id == attempt.run_id)
    )
    return newest == attempt.number


def settle_attempt(
    *, session: Session, run: Run, attempt: Attempt, now: datetime
) -> Attempt | None:
    """Move the run on after `attempt` ended (its worker finished it, or it was lost): the next
    phase, success, a pause, a failure with the attempt's cause, or a new attempt for the same
    phase from the latest checkpoint while the budget for how it ended lasts (preempted or
    lost: max_preemptions; failed with cause `infrastructure`: max_restarts). Both rows must be
    locked by the caller. Does not commit; returns the new attempt, if any."""
    if is_finished(run):
        # Cancelled while the worker ran: nothing follows.
        return None
    phases = run.plan["phases"]
    phase = f"phase {phases[attempt.phase_index]['name']!r}"
    where = f"attempt {attempt.number} in {phase} at step {run.step}"

    if attempt.status == AttemptStatus.SUCCEEDED:
        if attempt.phase_index + 1 == len(phases):
            move_run(run, RunStatus.SUCCEEDED, now=now)
            return None
        run.phase_index = attempt.phase_index + 1
        if run.pause_requested_at is not None:
            move_run(
                run,
                RunStatus.PAUSED,
                now=now,
                message=f"paused after {phase} ended; resume continues with the next phase",
            )
            return None
        move_run(run, RunStatus.RUNNING, now=now)
        return add_attempt(session=session, run=run, phase_index=run.phase_index)

    if attempt.status == AttemptStatus.FAILED and attempt.cause != RETRIED_CAUSE:
        move_run(
            run,
            RunStatus.FAILED,
            now=now,
            cause=attempt.cause,
            message=f"{where} failed: {attempt.message or 'the worker gave no reason'}",
        )
        return None

    yielded = (
        attempt.status == AttemptStatus.PAUSED
        and attempt.yield_requested_at is not None
        and run.status != RunStatus.PAUSED
        and run.pause_requested_at is None
    )
    if yielded:
        # It made room for a higher priority: queued again from the checkpoint it just wrote,
        # placed when workers free up; no budget is charged (budget_use counts paused as none).
        attempt.cause = PRIORITY_CAUSE
        attempt.message = (
            "yielded its workers to a higher-priority attempt after a checkpoint; the run "
            "continues by itself when workers free up"
        )
        move_run(
            run,
            RunStatus.RECOVERING,
            now=now,
            message=f"{where} yielded to a higher priority; queued again from its checkpoint",
        )
        return add_attempt(session=session, run=run, phase_index=attempt.phase_index)
    paused = AttemptStatus.PAUSED in (attempt.status, run.status)
    if paused or run.pause_requested_at is not None:
        move_run(
            run,
            RunStatus.PAUSED,
            now=now,
            message=(
                f"paused: {where} ended {attempt.status}; resume continues from the latest "
                "checkpoint"
            ),
        )
        return None

    use = budget_use(session.scalars(select(Attempt).where(Attempt.run_id == run.id)))
    if attempt.status in PREEMPTION_STATUSES:
        used, budget, name = use.preemptions, run.max_preemptions, "max_preemptions"
        if attempt.status == AttemptStatus.PREEMPTED:
            what = "was preempted"
        elif attempt.cause == "stalled":
            what = "stalled (its worker lives but made no progress)"
        else:
            what = "lost its worker"
    else:
        used, budget, name = use.restarts, run.max_restarts, "max_restarts"
        what = f"failed ({attempt.message or 'cause infrastructure'})"
    if used <= budget:
        move_run(
            run,
            RunStatus.RECOVERING,
            now=now,
            message=(
                f"{where} {what}; restarting from the latest checkpoint ({used} of {budget} "
                f"{name} used)"
            ),
        )
        return add_attempt(session=session, run=run, phase_index=attempt.phase_index)
    move_run(
        run,
        RunStatus.FAILED,
        now=now,
        cause="restarts_exhausted",
        message=(
            f"{where} {what}, and the run has used all {budget} of its {name}; resume it, or "
            f"submit it again with a larger {name}"
        ),
    )
    return None


def advance_run_step(session: Session, run_id: str, step: int) -> None:
    """Raise `run.step` to `step` (a report of the current attempt's update `step`), as one
    conditional UPDATE: a report never moves it back; only a claim or a heartbeat, which speak
    for the attempt as a whole, set it lower."""
    session.execute(
        update(Run)
        .where(Run.id == run_id, Run.step < step)
        .values(step=step, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
