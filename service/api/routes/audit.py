"""`GET /audit` (admin tokens only): the audit trail (service.audit), newest first, paged by
cursor, filtered by action and target."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict
from sqlalchemy import select

from service.api.deps import SessionDep, require_admin
from service.audit import AuditAction
from service.models import AuditEvent

MAX_AUDIT_PAGE = 500

router = APIRouter(prefix="/audit", tags=["audit"], dependencies=[Depends(require_admin)])


class AuditEventPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    at: datetime
    action: str
    target_id: str | None
    actor_token_id: str | None
    actor_name: str
    actor_role: str | None
    client_address: str | None
    details: dict[str, Any] | None


class AuditPublic(BaseModel):
    events: list[AuditEventPublic]
    # Pass as `cursor` for the next (older) page; None on the last page.
    next_cursor: str | None = None


@router.get("")
def read_audit(
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=MAX_AUDIT_PAGE)] = 100,
    action: AuditAction | None = None,
    target_id: Annotated[str | None, Query(max_length=200)] = None,
    cursor: Annotated[
        str | None, Query(max_length=18, description="the `next_cursor` of the previous page")
    ] = None,
) -> AuditPublic:
    """Who changed what, when and from where: newest first, `limit` a page."""
    query = select(AuditEvent)
    if cursor is not None:
        if not cursor.isdigit():
            raise RequestValidationError(
                [
                    {
                        "loc": ("query", "cursor"),
                        "msg": "is not a cursor this API gave out; pass `next_cursor` as it came",
                        "type": "value_error",
                    }
                ]
            )
        query = query.where(AuditEvent.id < int(cursor))
    if action is not None:
        query = query.where(AuditEvent.action == action)
    if target_id is not None:
        query = query.where(AuditEvent.target_id == target_id)
    rows = list(session.scalars(query.order_by(AuditEvent.id.desc()).limit(limit + 1)))
    following = None
    if len(rows) > limit:
        rows = rows[:limit]
        following = str(rows[-1].id)
    return AuditPublic(
        events=[AuditEventPublic.model_validate(r) for r in rows], next_cursor=following
    )
