"""Dependency aliases: a route's signature reads as its contract."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from service.auth import find_token
from service.dispatch import OutboxPump
from service.errors import ApiError
from service.models import ApiToken, Run
from service.run import get_run
from service.settings import ServiceSettings

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
    """Whether this process may judge a lease by its expiry now (service.reaper.Reaper)."""
    heard: bool = request.app.state.reaper.hearing()
    return heard


SettingsDep = Annotated[ServiceSettings, Depends(get_settings)]
LeasesHeardDep = Annotated[bool, Depends(leases_heard)]
SessionDep = Annotated[Session, Depends(get_session)]
PumpDep = Annotated[OutboxPump, Depends(get_pump)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def _authenticate(session: Session, credentials: HTTPAuthorizationCredentials | None) -> ApiToken:
    if credentials is None:
        message = (
            "missing bearer token; send 'Authorization: Bearer <token>' (the embedded service "
            "writes an admin token to $TRAINCTL_HOME/token)"
        )
    else:
        token = find_token(session=session, token=credentials.credentials)
        if token is not None:
            return token
        message = "unknown bearer token; check the token you sent, or create one"
    raise ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def require_admin(session: SessionDep, credentials: Credentials) -> ApiToken:
    token = _authenticate(session, credentials)
    if token.role != "admin":
        raise ApiError(
            403,
            "forbidden",
            f"token {token.name!r} is a {token.role} token; the public API needs an admin token",
        )
    return token


def require_worker(session: SessionDep, credentials: Credentials) -> ApiToken:
    token = _authenticate(session, credentials)
    if token.role != "worker":
        raise ApiError(
            403,
            "forbidden",
            f"token {token.name!r} is a {token.role} token; /internal/... takes worker tokens only",
        )
    return token


AdminDep = Annotated[ApiToken, Depends(require_admin)]
WorkerDep = Annotated[ApiToken, Depends(require_worker)]


def load_run(run_id: str, session: SessionDep) -> Run:
    return get_run(session=session, run_id=run_id)


RunDep = Annotated[Run, Depends(load_run)]
