"""Who may do what: token roles, the owners of runs and jobs, and the data roots paths lie in.

Roles (ApiToken.role):
- `admin`: the whole public API, tokens (`/tokens`) and the audit trail (`/audit`) included.
- `user`: creates runs and jobs, and reads and controls only its own: another owner's run or
  job answers 404 on every route that takes its id, as if it did not exist, and lists show
  only its own.
- `viewer`: reads everything (GET), changes nothing: every other method is 403.
- `worker`: `/internal/...` only (service.workers.lease scopes it further to what it claimed).

A run or job records its owner, the id of the token that created it: the authenticated token
rides on the request's session (`set_actor`), and a `before_flush` hook stamps it on every new
run and job, so the functions that create them need not know about owners. Rows created before
owners were recorded (migration 0010) have no owner: admins and viewers see them, no user does.
Ownership is by token id, which rotation keeps: a rotated token keeps its runs.

Workflows are content-addressed, so they are owned by a relation (models.WorkflowOwner): every token
that stored or ran one; a user sees those (service.runs.workflow.get_workflow with `owner_filter`).
Functions below the routes take that filter as `owner_id`, as list_runs does, and load one row for a
token with `can_see` (service.runs.run.run_for, service.workers.job.job_for).

Paths: every path a request names must resolve inside the data roots (TRAINCTL_DATA_ROOTS);
`outside_roots` names each one that does not. A path into a run's folder of the artifact store
is that run's, seen only by who may see the run (service.checkpoints.source.check_run_folders).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

from contracts.paths import DataRoots, PathUse
from service.errors import ApiError, summarize_problems
from service.models import ApiToken, Job, Run

# Who may use the public API, by method: reads, and everything else.
READ_ROLES = frozenset({"admin", "user", "viewer"})
WRITE_ROLES = frozenset({"admin", "user"})
READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

_ACTOR = "trainctl.actor"
_ADDRESS = "trainctl.client_address"


def set_actor(session: Session, token: ApiToken, address: str | None) -> None:
    """The token a request authenticated with, and where it came from, for the rest of the
    request's session: owners of what it creates, and its audit events (service.audit)."""
    session.info[_ACTOR] = token
    session.info[_ADDRESS] = address


def actor(session: Session) -> ApiToken | None:
    found: ApiToken | None = session.info.get(_ACTOR)
    return found


def client_address(session: Session) -> str | None:
    address: str | None = session.info.get(_ADDRESS)
    return address


def role_refusal(token: ApiToken, method: str, path: str) -> ApiError | None:
    """403 `forbidden` when `token`'s role may not call `method` on the public API."""
    allowed = READ_ROLES if method.upper() in READ_METHODS else WRITE_ROLES
    if token.role in allowed:
        return None
    if token.role == "viewer":
        why = "viewer tokens read and change nothing; this needs a user or admin token"
    elif token.role == "worker":
        why = "worker tokens use /internal/... only; the public API takes admin, user or viewer"
    else:
        why = f"the {token.role} role may not call it"
    return ApiError(
        403,
        "forbidden",
        f"{method.upper()} {path}: token {token.name!r} is a {token.role} token; {why}",
        {"role": token.role},
    )


def sees_everything(token: ApiToken) -> bool:
    return token.role in ("admin", "viewer")


def owner_filter(token: ApiToken) -> str | None:
    """The owner a list is limited to for `token`, or None for every row."""
    return None if sees_everything(token) else token.id


def can_see(token: ApiToken, owner_id: str | None) -> bool:
    return sees_everything(token) or (owner_id is not None and owner_id == token.id)


def outside_roots(
    fields: list[tuple[str, str, PathUse]], roots: DataRoots, *, where: str
) -> ApiError | None:
    """422 `path_outside_data_roots` naming each (JSON path, resolved path) of `fields` that
    `roots` refuses, with the path and the roots in its details; None when all may be read."""
    problems = [
        {
            "path": field,
            "message": why,
            "value": value,
            "roots": [str(r) for r in roots.allowed(use)],
        }
        for field, value, use in fields
        if (why := roots.refusal(value, use))
    ]
    if not problems:
        return None
    return ApiError(
        422,
        "path_outside_data_roots",
        f"{where}: {summarize_problems(problems)}; put the files under a data root, or have the "
        "operator add their folder to TRAINCTL_DATA_ROOTS",
        problems,
    )


@event.listens_for(Session, "before_flush")
def _stamp_owner(session: Session, _context: Any, _instances: Any) -> None:
    token = actor(session)
    if token is None or token.role not in WRITE_ROLES:
        return
    for obj in session.new:
        if isinstance(obj, Run | Job) and obj.owner_id is None:
            obj.owner_id = token.id
