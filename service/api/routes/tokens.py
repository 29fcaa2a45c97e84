"""Tokens (admin tokens only): `GET /tokens`, `POST /tokens`, `DELETE /tokens/{id}` (revoke),
`POST /tokens/{id}/rotate`, `PATCH /tokens/{id}` (its device quota); and `GET /whoami`, any
token's own id, name and role (the dashboard learns from it what to offer). A token's secret
is in the answer of its creation or rotation only; no answer ever carries a secret's hash."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, status

from contracts.api import (
    TokenCreate,
    TokenIssued,
    TokenPublic,
    TokensPublic,
    TokenUpdate,
    WhoAmI,
)
from service.access import READ_ROLES, WRITE_ROLES
from service.api.deps import AdminDep, AnyTokenDep, SessionDep, SettingsDep, require_admin
from service.auth import (
    get_token,
    issue_token,
    list_tokens,
    revoke_token,
    rotate_token,
    set_max_devices,
)
from service.models import ApiToken

router = APIRouter(tags=["tokens"])
admin = APIRouter(prefix="/tokens", tags=["tokens"], dependencies=[Depends(require_admin)])


def _public(row: ApiToken) -> TokenPublic:
    return TokenPublic.model_validate(row)


@router.get("/whoami")
def whoami(token: AnyTokenDep) -> WhoAmI:
    """The calling token's id, name and role, and what the role may do."""
    return WhoAmI(
        id=token.id,
        name=token.name,
        role=token.role,
        can_read=token.role in READ_ROLES,
        can_write=token.role in WRITE_ROLES,
        sees_all=token.role in ("admin", "viewer"),
        is_admin=token.role == "admin",
    )


@admin.get("")
def read_tokens(
    session: SessionDep,
    revoked: Annotated[bool, Query(description="list revoked tokens too")] = False,
) -> TokensPublic:
    """Tokens oldest first, without their secrets."""
    rows = list_tokens(session=session, revoked=revoked)
    return TokensPublic(tokens=[_public(r) for r in rows], count=len(rows))


@admin.post("", status_code=status.HTTP_201_CREATED)
def create(body: TokenCreate, session: SessionDep) -> TokenIssued:
    """A new token of `role` (default `user`); its secret is in this answer only."""
    row, secret = issue_token(
        session=session, name=body.name, role=body.role, max_devices=body.max_devices
    )
    return TokenIssued(token=_public(row), secret=secret)


@admin.delete("/{token_id}")
def revoke(
    token_id: str,
    session: SessionDep,
    caller: AdminDep,
    allow_self: Annotated[
        bool,
        Query(description="revoke the very token this request is made with (locks it out)"),
    ] = False,
) -> TokenPublic:
    """Revoke the token: refused from the next request on. Again is a no-op. The token this
    request is made with is refused (409 `revoking_own_token`) unless `allow_self=true`."""
    return _public(
        revoke_token(session=session, token_id=token_id, caller=caller.id, allow_self=allow_self)
    )


@admin.patch("/{token_id}")
def update(token_id: str, body: TokenUpdate, session: SessionDep) -> TokenPublic:
    """Set the token's `max_devices`: the most devices its runs' attempts hold placed or
    running at once (null: unlimited). A field left out stays. Queued attempts over it wait
    (`waiting_reason`); running ones are not stopped."""
    row = get_token(session=session, token_id=token_id)
    if "max_devices" in body.model_fields_set:
        row = set_max_devices(session=session, token_id=token_id, max_devices=body.max_devices)
    return _public(row)


@admin.post("/{token_id}/rotate")
def rotate(token_id: str, session: SessionDep, settings: SettingsDep) -> TokenIssued:
    """A new secret for the token (same id, name, role and runs); the old one is refused from
    the next request on. An embedded token file in the service's home that held the old secret
    (`token`, `worker-token`) is rewritten with the new one. 409 `token_revoked` for a revoked
    token."""
    row, secret = rotate_token(session=session, token_id=token_id, home=settings.home)
    return TokenIssued(token=_public(row), secret=secret)


router.include_router(admin)
