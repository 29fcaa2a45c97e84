"""Dependency aliases: a route's signature reads as its contract."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from contracts.bounds import MAX_NAME
from service import access
from service.auth import find_token
from service.errors import ApiError
from service.models import ApiToken, Run
from service.reads.series import MAX_SERIES_PER_READ
from service.runs.run import run_for
from service.settings import ServiceSettings
from service.workers.dispatch import OutboxPump

_bearer = HTTPBearer(auto_error=False)


def get_settings(request: Request) -> ServiceSettings:
    settings: ServiceSettings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.session_factory() as session:
        yield session


def get_pump(request: Request) -> OutboxPump:
    pump: OutboxPump = request.app.state.pump
    return pump


def leases_heard(request: Request) -> bool:
    """Whether this process may judge a lease by its expiry now (service.workers.reaper.Reaper)."""
    heard: bool = request.app.state.reaper.hearing()
    return heard


SettingsDep = Annotated[ServiceSettings, Depends(get_settings)]
LeasesHeardDep = Annotated[bool, Depends(leases_heard)]
SessionDep = Annotated[Session, Depends(get_session)]
PumpDep = Annotated[OutboxPump, Depends(get_pump)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def authenticate(
    session: Session, credentials: HTTPAuthorizationCredentials | None, request: Request
) -> ApiToken:
    """The token the request carries, or 401. A revoked token is unknown from the next request
    on. The token rides on `session` for owners and the audit trail (service.access)."""
    if credentials is None:
        message = (
            "missing bearer token; send 'Authorization: Bearer <token>' (the embedded service "
            "writes an admin token to $TRAINCTL_HOME/token)"
        )
    else:
        token = find_token(session=session, token=credentials.credentials)
        if token is not None:
            access.set_actor(session, token, request.client.host if request.client else None)
            return token
        # Never the token itself: error bodies end up in logs.
        message = "unknown or revoked bearer token; check the token you sent, or ask for one"
    raise ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def require_token(request: Request, session: SessionDep, credentials: Credentials) -> ApiToken:
    """Any valid token (`GET /whoami`)."""
    return authenticate(session, credentials, request)


def require_api(request: Request, session: SessionDep, credentials: Credentials) -> ApiToken:
    """The public API: reads (GET) for admin, user and viewer tokens; every other method for
    admin and user tokens (service.access); 403 otherwise."""
    token = authenticate(session, credentials, request)
    refused = access.role_refusal(token, request.method, request.url.path)
    if refused is not None:
        raise refused
    return token


def require_admin(request: Request, session: SessionDep, credentials: Credentials) -> ApiToken:
    token = authenticate(session, credentials, request)
    if token.role != "admin":
        raise ApiError(
            403,
            "forbidden",
            f"{request.method} {request.url.path}: token {token.name!r} is a {token.role} "
            "token; this needs an admin token",
            {"role": token.role},
        )
    return token


def require_worker(request: Request, session: SessionDep, credentials: Credentials) -> ApiToken:
    token = authenticate(session, credentials, request)
    if token.role != "worker":
        raise ApiError(
            403,
            "forbidden",
            f"token {token.name!r} is a {token.role} token; /internal/... takes worker tokens only",
        )
    return token


AdminDep = Annotated[ApiToken, Depends(require_admin)]
WorkerDep = Annotated[ApiToken, Depends(require_worker)]
# The public API's caller (require_api), for routes that check owners.
ApiTokenDep = Annotated[ApiToken, Depends(require_api)]
AnyTokenDep = Annotated[ApiToken, Depends(require_token)]


def load_run(run_id: str, session: SessionDep, token: ApiTokenDep) -> Run:
    """The run, or 404 when it does not exist or the caller may not see it."""
    return run_for(session, token, run_id)


RunDep = Annotated[Run, Depends(load_run)]


def metric_names(
    names: Annotated[
        str | None,
        Query(
            description=f"comma-separated metric names: at most {MAX_SERIES_PER_READ}, each "
            f"of at most {MAX_NAME} characters"
        ),
    ] = None,
) -> list[str] | None:
    """The metric names a read asks for (`names`, comma-separated; blanks dropped), or None
    for the route's default; 422 naming `query.names` past the bounds (MAX_SERIES_PER_READ
    names, each of MAX_NAME characters, the longest a stored name can be)."""
    wanted = [name.strip() for name in (names or "").split(",") if name.strip()]
    long = next((name for name in wanted if len(name) > MAX_NAME), None)
    why = None
    if len(wanted) > MAX_SERIES_PER_READ:
        why = f"names {len(wanted)} metrics; ask for at most {MAX_SERIES_PER_READ} per read"
    elif long is not None:
        why = (
            f"holds a name of {len(long)} characters ({long[:40]!r}...); a metric name has "
            f"at most {MAX_NAME}"
        )
    if why is not None:
        raise RequestValidationError(
            [{"loc": ("query", "names"), "msg": why, "type": "value_error"}]
        )
    return wanted or None


# `names` of a metric read (GET /runs/{id}/metrics and /events), checked: None when not given.
MetricNamesDep = Annotated[list[str] | None, Depends(metric_names)]
