"""The audit trail: who changed what, when and from where (models.AuditEvent), read by admins
with `GET /audit`.

Recorded: run creation, resume, pause, cancel and update (name, tags, note); job creation;
token creation, revocation and rotation. An event is written in the transaction of the change
it records, so a change that rolls back (a 409, a crash) leaves no event, and a committed
change always has one:

- Token changes (service.auth) add their event themselves (`record`).
- Run and job changes are made by functions that know nothing of auditing and commit when they are
  done (service.runs.run, service.runs.resume, service.runs.control, service.workers.job). Their
  route announces the change first (`expect`); a `before_commit` hook adds the event to the first
  commit of the request's session that writes anything. A commit that only ends a read (create_run
  commits before hashing) or a no-op that rolls back (pausing a paused run) writes nothing and
  records nothing. For a creation the target is the run or job the transaction inserted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

from sqlalchemy import event
from sqlalchemy.orm import ORMExecuteState, Session

from service.access import actor, client_address
from service.models import ApiToken, AuditEvent, Job, Run, utcnow

# What an event records, as `GET /audit?action=` names it.
AuditAction = Literal[
    "run.create",
    "run.resume",
    "run.pause",
    "run.cancel",
    "run.update",
    "job.create",
    "token.create",
    "token.revoke",
    "token.rotate",
    "token.update",
]
ACTIONS: tuple[str, ...] = get_args(AuditAction)

_EXPECTED = "trainctl.audit.expected"
_WROTE = "trainctl.audit.wrote"
_CREATED = "trainctl.audit.created"


@dataclass
class _Expected:
    action: str
    target_id: str | None
    details: dict[str, Any] | None


def record(
    session: Session,
    action: str,
    target_id: str | None,
    *,
    details: dict[str, Any] | None = None,
    token: ApiToken | None = None,
    actor_name: str | None = None,
    address: str | None = None,
) -> AuditEvent:
    """Add an event to the session's transaction (the caller commits it with its change). The
    actor is `token`, else the request's (service.access.actor); `actor_name` names one without
    a token (`trainctl tokens` on the database)."""
    assert action in ACTIONS, action
    who = token if token is not None else actor(session)
    event_ = AuditEvent(
        at=utcnow(),
        action=action,
        target_id=target_id,
        actor_token_id=None if who is None else who.id,
        actor_name=(who.name if who is not None else actor_name) or "unknown",
        actor_role=None if who is None else who.role,
        client_address=address if address is not None else client_address(session),
        details=details,
    )
    session.add(event_)
    return event_


def expect(
    session: Session,
    action: str,
    target_id: str | None = None,
    details: dict[str, Any] | None = None,
) -> None:
    """Record `action` on `target_id` (None: the run or job the transaction creates) with the
    first commit of this session that writes anything."""
    assert action in ACTIONS, action
    session.info[_EXPECTED] = _Expected(action, target_id, details)


def _reset(session: Session) -> None:
    session.info.pop(_WROTE, None)
    session.info.pop(_CREATED, None)


@event.listens_for(Session, "do_orm_execute")
def _note_statement(state: ORMExecuteState) -> None:
    if state.is_insert or state.is_update or state.is_delete:
        state.session.info[_WROTE] = True


@event.listens_for(Session, "after_flush")
def _note_flush(session: Session, _context: Any) -> None:
    if _EXPECTED not in session.info:
        return
    if session.new or session.deleted or any(session.is_modified(o) for o in session.dirty):
        session.info[_WROTE] = True
    created = [o.id for o in session.new if isinstance(o, Run | Job)]
    if created:
        session.info.setdefault(_CREATED, []).extend(created)


@event.listens_for(Session, "before_commit")
def _add_expected(session: Session) -> None:
    expected: _Expected | None = session.info.get(_EXPECTED)
    if expected is None:
        return
    if not session.info.get(_WROTE) and not (session.new or session.dirty or session.deleted):
        return
    target = expected.target_id
    if target is None:
        created = session.info.get(_CREATED) or [
            o.id for o in session.new if isinstance(o, Run | Job)
        ]
        target = created[0] if created else None
    del session.info[_EXPECTED]
    record(session, expected.action, target, details=expected.details)


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    _reset(session)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    _reset(session)
